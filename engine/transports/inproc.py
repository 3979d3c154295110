"""`inproc`: writer and pool in one process (unit tests of the workers and the handoff protocol).

Writes synchronously into a KVCache found in a registry (a dict the caller shares between endpoints
and senders) by the descriptor's id, inside the fence like shm. It notifies like NIXL does (the
endpoint's `poll` reports finished requests), so it exercises the notification path without IPC.
"""

from __future__ import annotations

import itertools

import torch

from engine.kv_pool import KVCache
from engine.transports.base import KVSender, LayerWriter, Notices, PoolEndpoint, TransferState, copy_into_pages
from engine.transports.fence import FenceGuard
from tandem.kv_layout import KVLayout
from tandem.pool import Destination, InprocPool
from tandem.status import TandemError, TransferFailed

NAME = "inproc"
_IDS = itertools.count()


def unavailable() -> str:
    return ""


class InprocEndpoint(PoolEndpoint):
    name = NAME
    notifies = True

    def __init__(self, cache: KVCache, fence_name: str, registry: dict):
        self.cache = cache
        self.fence_name = fence_name
        self.id = f"inproc-{next(_IDS)}"
        self._arrived: set[str] = set()
        self.registry = registry
        registry[self.id] = self

    def part(self) -> InprocPool:
        return InprocPool(id=self.id)

    def poll(self) -> Notices:
        out, self._arrived = self._arrived, set()
        return Notices(ready=out)

    def close(self) -> None:
        self.registry.pop(self.id, None)


class InprocWriter(LayerWriter):
    def __init__(self, endpoint: InprocEndpoint, request_id: str, dest: Destination, layout: KVLayout):
        super().__init__(request_id, dest, layout)
        self.endpoint = endpoint
        self.guard = FenceGuard(endpoint.fence_name)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, runs: list) -> None:
        try:
            with self.guard.hold(self.dest.slot, self.dest.epoch):
                copy_into_pages(self.endpoint.cache.data[layer, 0], runs, k)
                copy_into_pages(self.endpoint.cache.data[layer, 1], runs, v)
        except TandemError as e:
            self.fail(e)
            return
        self.bytes_written += 2 * k.numel() * k.element_size()

    def finish(self) -> None:
        self.guard.close()
        if self.error is not None:
            raise self.error
        self.state = TransferState.DONE
        self.endpoint._arrived.add(self.request_id)

    def abort(self) -> None:
        if self.state is TransferState.WRITING:
            self.state = TransferState.ABORTED
        self.guard.close()


class InprocSender(KVSender):
    name = NAME

    def __init__(self, layout: KVLayout, registry: dict, device: str = "cpu"):
        super().__init__(layout)
        self.registry = registry

    def writer(self, dest: Destination, request_id: str) -> InprocWriter:
        part = self.check(dest)
        endpoint = self.registry.get(part.id)
        if endpoint is None:
            raise TransferFailed(f"no in-process pool {part.id!r} (closed, or in another process)")
        return InprocWriter(endpoint, request_id, dest, self.layout)
