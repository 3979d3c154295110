"""The pull handoff's read side: a decode worker reads a request's K/V out of a prefill worker's pool.

Pull turns the push handoff around (control/pull_attempt.py has the whole protocol): the prefill
worker keeps a request's K/V in pages of its own pool, exported like a decode pool (engine/transports/
host.py: a shared-memory region, a GPU export or NIXL-registered memory, and a fence table), and hands
out a `PullSource`. The decode worker reserves pages of its own and calls `KVReader.read`, which copies
positions [start, source.tokens) from the source pages into them (`start`: what its prefix cache
already holds).

The fence, mirrored. Readers that share the prefill pool's memory (shm, cuda_ipc, inproc) read every
layer inside the source's fence: a read lock on its slot of the prefill pool's fence table with the
epoch checked (engine/transports/fence.py). Once the prefill worker revokes the slot (the hold ended),
no check passes: the read fails with LeaseLost and nothing of that layer was read. The prefill worker
reuses the pages only after the revoke took the slot's write lock, so a reader stopped in the middle
of a copy keeps them out of use until it resumes or dies (`strict` readers). A NIXL READ is one-sided
and cannot be fenced that way: see engine/transports/pull_nixl.py and engine/workers/holds.py.

Transports: `shm` and `inproc` here, `nixl` (pull_nixl.py, any host UCX reaches) and `cuda_ipc`
(pull_cuda_ipc.py, a prefill pool in GPU memory on this host), imported only when used.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from engine.kv_pool import KVCache
from engine.shm_region import SHM_DIR
from engine.transports.base import pool_part
from engine.transports.fence import FenceGuard
from tandem.kv_layout import KVLayout
from tandem.pool import PullSource
from tandem.status import Cancelled, TransferFailed

PULL_TRANSPORTS = ("shm", "cuda_ipc", "nixl", "inproc")
ONE_HOST = ("shm", "cuda_ipc", "inproc")  # readers that must share the prefill pool's host


class KVReader(ABC):
    """Reads held K/V from other workers' pools into this worker's pool; one per transport and process."""

    name: str

    def __init__(self, layout: KVLayout):
        self.layout = layout  # the decode engine's layout; a source pool must match it

    def check(self, source: PullSource):
        """The source pool's part for this transport; TransferFailed if absent or incompatible."""
        part = pool_part(source.pool, self.name, self.layout, "source")
        bad = [p for p in source.page_ids if not 0 <= p < source.pool.num_pages]
        if not source.page_ids or bad or self.layout.pages_for(source.tokens) > len(source.page_ids):
            raise TransferFailed(f"request {source.request_id}: source pages must be pages of a pool with "
                                 f"{source.pool.num_pages} pages, enough for {source.tokens} tokens")
        return part

    def read(self, source: PullSource, cache: KVCache, page_ids: list[int], start: int = 0,
             stopped: Callable[[], bool] = lambda: False) -> int:
        """Copy positions [start, source.tokens) into `page_ids` (the request's page table in `cache`);
        returns the bytes read. Raises LeaseLost (the hold was revoked), Cancelled (`stopped()` turned
        true before a layer, or before the transfer) or TransferFailed. Whole pages are copied:
        positions past `tokens` in the last page are the request's own to overwrite. When it returns or
        raises, nothing it started is still writing into `page_ids`."""
        tpp = self.layout.tokens_per_page
        if start % tpp:
            raise TransferFailed(f"request {source.request_id}: a read must start on a page boundary "
                                 f"(multiple of {tpp}), got position {start}")
        self.check(source)
        first, n = start // tpp, self.layout.pages_for(source.tokens)
        if n > len(page_ids):
            raise TransferFailed(f"request {source.request_id}: {source.tokens} tokens need {n} pages, "
                                 f"the destination has {len(page_ids)}")
        if first >= n:
            return 0
        self._copy(source, cache, source.page_ids[first:n], page_ids[first:n], stopped)
        return (n - first) * tpp * self.layout.bytes_per_token

    @abstractmethod
    def _copy(self, source: PullSource, cache: KVCache, src_pages: list[int], dst_pages: list[int],
              stopped: Callable[[], bool]) -> None:
        """Copy whole pages src_pages of the source pool into dst_pages of `cache`, every layer, K and V."""

    def say_closed(self, source: PullSource) -> None:
        """Tell the source's pool that nothing of this reader is in flight for the source (its hold may
        end without waiting for a read): after every read, and for an Open refused before any. Nothing
        for readers whose every read the source's fence checks (shm, cuda_ipc, inproc); never raises."""
        return None

    def progress_due(self) -> float | None:
        """When (monotonic) `progress` should next be called; None: nothing is pending (see KVSender)."""
        return None

    def progress(self) -> None:
        return None

    def close(self) -> None:
        return None


class FencedReader(KVReader):
    """A reader that maps the source pool's memory: every layer is copied under the slot's fence lock."""

    def __init__(self, layout: KVLayout):
        super().__init__(layout)
        self.peers: dict = {}  # source pools opened so far (each with .data, .fence_name, .close()), by export key

    def _peer(self, key: str, open_new: Callable[[], object], errors: tuple, what: str):
        """(pages, a fence guard of our own) of the source pool exported under `key`, opened once by
        `open_new`. Pools whose prefill worker stopped (their fence table is gone) are closed first. A pool
        that cannot be opened is TransferFailed naming `what`."""
        if key not in self.peers:
            for k in [k for k, o in self.peers.items() if not os.path.exists(os.path.join(SHM_DIR, o.fence_name))]:
                self.peers.pop(k).close()
            try:
                self.peers[key] = open_new()
            except errors as e:
                raise TransferFailed(f"cannot open {what}: {e} (is the prefill worker running on this host?)") from None
        o = self.peers[key]
        return o.data, FenceGuard(o.fence_name)

    def close(self) -> None:
        for o in self.peers.values():
            o.close()
        self.peers.clear()

    @abstractmethod
    def _open(self, source: PullSource) -> tuple[torch.Tensor, FenceGuard]:
        """The source pool's pages [layers, 2, pages, tokens_per_page, kv_heads, head_dim] and a guard
        of our own on its fence table (closed by the caller)."""

    def _copy(self, source, cache, src_pages, dst_pages, stopped) -> None:
        data, guard = self._open(source)
        src = torch.tensor(src_pages, device=data.device)  # [P]
        dst = torch.tensor(dst_pages, device=cache.device)  # [P]
        try:
            with torch.inference_mode():
                for layer in range(self.layout.num_layers):
                    if stopped():
                        raise Cancelled(f"request {source.request_id}: the read was stopped")
                    with guard.hold(source.slot, source.epoch):
                        self._copy_layer(data[layer], cache.data[layer], src, dst)
        finally:
            guard.close()

    def _copy_layer(self, src_layer: torch.Tensor, dst_layer: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor) -> None:
        """src_layer, dst_layer: [2, pages, tokens_per_page, kv_heads, head_dim]; src, dst: [P] page ids.
        Returns only once the copy is complete (the fence lock drops right after)."""
        dst_layer.index_copy_(1, dst, src_layer.index_select(1, src).to(dst_layer.device))


class ShmReader(FencedReader):
    name = "shm"

    def _open(self, source: PullSource):
        from engine.transports.shm import MappedPool

        part = self.check(source)
        return self._peer(part.segment, lambda: MappedPool(part, source.pool.layout, source.pool.num_pages),
                          (OSError, ValueError), f"prefill pool {part.segment!r}")


class InprocReader(FencedReader):
    name = "inproc"

    def __init__(self, layout: KVLayout, registry: dict):
        super().__init__(layout)
        self.registry = registry

    def _open(self, source: PullSource):
        part = self.check(source)
        endpoint = self.registry.get(part.id)
        if endpoint is None:
            raise TransferFailed(f"no in-process pool {part.id!r} (closed, or in another process)")
        return endpoint.cache.data, FenceGuard(endpoint.fence_name)


def reader(name: str, layout: KVLayout, registry: dict | None = None) -> KVReader:
    """The read side of a transport; TransferFailed for an unknown one or one that cannot run here
    (NIXL not installed, no CUDA)."""
    if name == "shm":
        return ShmReader(layout)
    if name == "inproc":
        return InprocReader(layout, registry if registry is not None else {})
    if name == "nixl":
        from engine.transports import nixl
        from engine.transports.pull_nixl import NixlReader

        if why := nixl.unavailable():
            raise TransferFailed(f"the pull handoff cannot read over nixl here: {why}")
        return NixlReader(layout)
    if name == "cuda_ipc":
        from engine.transports import cuda_ipc
        from engine.transports.pull_cuda_ipc import CudaIpcReader

        if why := cuda_ipc.unavailable():
            raise TransferFailed(f"the pull handoff cannot read over cuda_ipc here: {why}")
        return CudaIpcReader(layout)
    raise TransferFailed(f"unknown transport {name!r}; the pull handoff reads over {', '.join(PULL_TRANSPORTS)}")
