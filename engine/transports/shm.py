"""`shm`: the decode pool lives in owner-only POSIX shared memory; prefill maps it and writes in place.

One host, no dependency, zero serialization: a layer's K/V go from the prefill worker's tensors
straight into the decode worker's pages (one indexed copy). Writes run on a background thread so a
layer's copy overlaps the next layer's compute. Completion is signalled by the prefill reply itself:
`finish` returns after the last copy, before the orchestrator is told the pages are ready.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.kv_pool import TORCH_DTYPES, KVCache
from engine.shm import SHM_DIR, SharedBuffer
from engine.transports.base import KVSender, LayerWriter, PoolEndpoint, TransferError, TransferState
from tandem.kv_layout import KVLayout

NAME = "shm"


class ShmEndpoint(PoolEndpoint):
    def __init__(self, cache: KVCache):
        if cache.shm is None:
            raise ValueError("the shm transport needs a KV pool created with shared=True")
        self.cache = cache

    def descriptor(self) -> dict:
        return {"transport": NAME, "segment": self.cache.shm.name, "bytes": self.cache.shm.size,
                "num_pages": self.cache.num_pages, "layout": self.cache.layout.to_dict()}


class _Mapped:
    """A decode pool mapped into this process: flat per-layer views [layers, 2, pages*tpp, Hkv, hd]."""

    def __init__(self, segment: str, size: int, layout: KVLayout, num_pages: int):
        self.buf = SharedBuffer.attach(segment, size)
        self.buf.prefault()
        shape = (layout.num_layers, 2, num_pages * layout.tokens_per_page, layout.num_kv_heads, layout.head_dim)
        self.flat = self.buf.tensor(TORCH_DTYPES[layout.dtype], shape)

    def close(self) -> None:
        del self.flat
        self.buf.close()


class ShmWriter(LayerWriter):
    def __init__(self, sender: "ShmSender", mapped: _Mapped, request_id: str, page_ids: list[int],
                 layout: KVLayout, num_pages: int):
        super().__init__(request_id, page_ids, layout, num_pages)
        self.sender = sender
        self.mapped = mapped
        self.pending: list[Future] = []
        self._slots_cache: torch.Tensor | None = None

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.state is not TransferState.WRITING:
            raise TransferError(f"request {self.request_id}: writer is {self.state.value}")
        if self._slots_cache is None or len(self._slots_cache) != k.shape[0]:
            self._slots_cache = self._slots(k.shape[0], torch.device("cpu"))
        self.pending.append(self.sender.pool.submit(self._copy, layer, k, v, self._slots_cache))

    def _copy(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        if self.state is not TransferState.WRITING:
            return
        with torch.inference_mode():
            self.mapped.flat[layer, 0].index_copy_(0, slots, k.to("cpu", self.mapped.flat.dtype))
            self.mapped.flat[layer, 1].index_copy_(0, slots, v.to("cpu", self.mapped.flat.dtype))
        self.bytes_written += 2 * k.numel() * self.mapped.flat.element_size()

    def finish(self) -> None:
        try:
            for f in self.pending:
                f.result()
        except Exception as e:  # any failure of a background copy fails the whole transfer
            self.state = TransferState.FAILED
            raise TransferError(f"request {self.request_id}: writing pages failed: {e}") from e
        if self.state is TransferState.WRITING:
            self.state = TransferState.DONE

    def abort(self) -> None:
        self.state = TransferState.ABORTED
        for f in self.pending:
            f.cancel()


class ShmSender(KVSender):
    def __init__(self, layout: KVLayout):
        super().__init__(layout)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-shm")
        self.mapped: dict[str, _Mapped] = {}

    def writer(self, pool: dict, request_id: str, page_ids: list[int]) -> ShmWriter:
        layout, num_pages = self.check_descriptor(pool, NAME)
        segment = pool.get("segment")
        if segment not in self.mapped:
            self._drop_stale()
            try:
                self.mapped[segment] = _Mapped(segment, int(pool.get("bytes", 0)), layout, num_pages)
            except (OSError, ValueError) as e:
                raise TransferError(f"cannot map decode pool {segment!r}: {e} (is the decode worker running?)") from None
        return ShmWriter(self, self.mapped[segment], request_id, page_ids, layout, num_pages)

    def _drop_stale(self) -> None:
        """Unmap pools whose segment is gone (their decode worker stopped)."""
        for name in [n for n in self.mapped if not os.path.exists(os.path.join(SHM_DIR, n))]:
            self.mapped.pop(name).close()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for m in self.mapped.values():
            m.close()
        self.mapped.clear()
