"""The pull handoff's `cuda_ipc` read side: a decode worker reads held K/V out of a prefill worker's pool
in GPU memory on its own host, device to device.

The prefill pool is exported as push exports a decode pool (engine/transports/cuda_ipc.py: torch's
CUDA IPC handle in a CudaIpcPool, fence table beside it); this side opens it once per pool and copies
layer by layer inside the fence as the shm reader does (engine/transports/pull.py). Each layer's copy
is stream-ordered: a copy stream on the source GPU first waits for everything already queued on the
decode pool's GPU (the reserved pages are quiet), gathers the source pages, a stream on the decode GPU
waits for that and scatters them into the reserved pages, and a completion event is synchronized
before the fence lock drops, so a revoke never finds a copy in flight. The prefill worker answered
Prefilled only after the pass that computed the K/V ended (the first token was read back to the host),
so every source page is complete before any read of it starts.

Nothing here has run on a GPU yet: tests/transports/test_read_conformance.py runs it under the `gpu`
marker, and scripts/gpu_check/pull_ipc_check.py on the first GPU lent to the project.
"""

from __future__ import annotations

import torch

from engine.transports.cuda_ipc import OpenedPool
from engine.transports.pull import FencedReader
from tandem.kv_layout import KVLayout
from tandem.pool import PullSource
from tandem.status import TransferFailed


class CudaIpcReader(FencedReader):
    name = "cuda_ipc"

    def __init__(self, layout: KVLayout):
        super().__init__(layout)
        self.streams: dict[torch.device, torch.cuda.Stream] = {}  # a copy stream per GPU

    def _open(self, source: PullSource):
        part = self.check(source)
        return self._peer(part.handle, lambda: OpenedPool(part, source.pool.layout, source.pool.num_pages),
                          (RuntimeError, ValueError), "the prefill pool's CUDA IPC handle")

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device=device)
        return self.streams[device]

    def _copy_layer(self, src_layer, dst_layer, src, dst) -> None:
        """src_layer: [2, pages, tpp, Hkv, hd] on the prefill pool's GPU; dst_layer the same shape on the
        decode pool's GPU (the same GPU when both workers share one); src, dst: [P] page ids there."""
        if not dst_layer.is_cuda:
            raise TransferFailed("cuda_ipc reads into a decode pool in GPU memory; this one is in host memory "
                                 "(run the decode worker on a GPU, or read over nixl)")
        gather, scatter = self._stream(src_layer.device), self._stream(dst_layer.device)
        gather.wait_stream(torch.cuda.current_stream(dst_layer.device))  # nothing queued may touch the pages
        with torch.cuda.stream(gather):
            kv = src_layer.index_select(1, src)  # [2, P, tpp, Hkv, hd] on the prefill pool's GPU
        scatter.wait_stream(gather)
        with torch.cuda.stream(scatter):
            dst_layer.index_copy_(1, dst, kv.to(dst_layer.device, non_blocking=True))
            landed = torch.cuda.Event()
            landed.record(scatter)
        landed.synchronize()  # in the decode pool before the fence lock drops
