"""`inproc`: writer and pool in one process (unit tests, and the co-located engine's own pool).

Writes synchronously into a KVCache object found in a registry (a dict the caller shares between
endpoints and senders) by the descriptor's id. It notifies like NIXL does (the endpoint's `poll`
reports finished requests), so it exercises the notification path of the handoff without any IPC.
"""

from __future__ import annotations

import itertools

import torch

from engine.kv_pool import KVCache
from engine.transports.base import (KVSender, LayerWriter, PoolEndpoint, TransferError, TransferState,
                                    copy_into_pages)
from tandem.kv_layout import KVLayout

NAME = "inproc"
_IDS = itertools.count()


class InprocEndpoint(PoolEndpoint):
    notifies = True

    def __init__(self, cache: KVCache, registry: dict):
        self.cache = cache
        self.id = f"inproc-{next(_IDS)}"
        self._arrived: set[str] = set()
        self.registry = registry
        registry[self.id] = self

    def descriptor(self) -> dict:
        return {"transport": NAME, "id": self.id, "num_pages": self.cache.num_pages,
                "layout": self.cache.layout.to_dict()}

    def poll(self) -> set[str]:
        out, self._arrived = self._arrived, set()
        return out

    def close(self) -> None:
        self.registry.pop(self.id, None)


class InprocWriter(LayerWriter):
    def __init__(self, endpoint: InprocEndpoint, request_id: str, page_ids: list[int], layout: KVLayout):
        super().__init__(request_id, page_ids, layout, endpoint.cache.num_pages)
        self.endpoint = endpoint

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        if self.state is not TransferState.WRITING:
            raise TransferError(f"request {self.request_id}: writer is {self.state.value}")
        runs = self._runs(k.shape[0], start)
        copy_into_pages(self.endpoint.cache.data[layer, 0], runs, k)
        copy_into_pages(self.endpoint.cache.data[layer, 1], runs, v)
        self.bytes_written += 2 * k.numel() * k.element_size()

    def finish(self) -> None:
        if self.state is TransferState.WRITING:
            self.state = TransferState.DONE
            self.endpoint._arrived.add(self.request_id)

    def abort(self) -> None:
        self.state = TransferState.ABORTED


class InprocSender(KVSender):
    def __init__(self, layout: KVLayout, registry: dict):
        super().__init__(layout)
        self.registry = registry

    def writer(self, pool: dict, request_id: str, page_ids: list[int]) -> InprocWriter:
        layout, _ = self.check_descriptor(pool, NAME)
        endpoint = self.registry.get(pool.get("id"))
        if endpoint is None:
            raise TransferError(f"no in-process pool {pool.get('id')!r} (closed, or in another process)")
        return InprocWriter(endpoint, request_id, page_ids, layout)
