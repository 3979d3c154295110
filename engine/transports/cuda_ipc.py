"""`cuda_ipc`: the decode pool lives in GPU memory and is exported as a CUDA IPC memory handle; a prefill
worker on the same host opens it and copies each layer's K/V device to device into the leased pages.

The export is torch's own (`UntypedStorage._share_cuda_()`): the allocation's cudaIpcMemHandle, the
pool's size and offset in it, torch's shared reference counter and an IPC event, carried as base64
strings in the typed descriptor (tandem/pool.py: CudaIpcPool), never pickled. The opener finds the GPU
by its UUID, since two processes number their GPUs differently (CUDA_VISIBLE_DEVICES); it must be able
to see that GPU (ops/gpu_plan.py keeps the node's GPUs visible to workers for this). Copies ride
NVLink or PCIe peer-to-peer between two GPUs, or stay on one GPU when both workers share it.

Ordering and the fence: `write_layer` records an event on the prefill engine's stream and hands the
layer to this sender's copy thread, which, inside the lease's fence (engine/transports/fence.py, as
shm), makes its copy stream wait for that event, enqueues the page copies, records a completion event
and synchronizes it before it drops the fence lock. So the compute thread never waits for a copy, a
revoke never finds a copy in flight, and `finish` (hence `done`) returns only once every layer landed.
Only between processes of one host identity (tandem.pool.host_identity); across hosts, NIXL.
torch exports only memory of its caching allocator's ordinary segments: with expandable segments
(PYTORCH_CUDA_ALLOC_CONF) the export may fail, and the decode worker then fails at start with torch's error.
Nothing here has run on a GPU yet: the conformance suite covers it under the `gpu` marker.
"""

from __future__ import annotations

import base64
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.kv_pool import TORCH_DTYPES, KVCache
from engine.shm_region import SHM_DIR
from engine.transports.base import KVSender, PoolEndpoint, TransferState, copy_into_pages
from engine.transports.shm import ShmWriter
from tandem.kv_layout import KVLayout
from tandem.pool import CudaIpcPool, Destination
from tandem.status import TandemError, TransferFailed

NAME = "cuda_ipc"


def unavailable() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device is visible to this process (cuda_ipc copies between GPUs of one host)"
    return ""


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid`; TransferFailed if it cannot see that GPU."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise TransferFailed("the exported pool's GPU is not visible to this process (CUDA_VISIBLE_DEVICES); "
                         "cuda_ipc needs both workers' GPUs visible to both, or use nixl")


def _b64(raw: bytes | None) -> str:
    return base64.b64encode(raw or b"").decode()


class CudaIpcEndpoint(PoolEndpoint):
    name = NAME

    def __init__(self, cache: KVCache, fence_name: str, registry: dict | None = None):
        if cache.device.type != "cuda":
            raise ValueError("the cuda_ipc transport needs a KV pool in GPU memory (a decode worker on --device cuda)")
        # (device, handle, storage bytes, offset bytes, ref counter handle, ref counter offset, event handle,
        # event sync required): torch's export of the storage, as torch.multiprocessing sends it
        _, handle, size, offset, ref, ref_offset, event, sync = cache.data.untyped_storage()._share_cuda_()
        self.cache = cache
        self._part = CudaIpcPool(device_uuid=device_uuid(cache.device.index or 0), handle=_b64(handle),
                                 storage_bytes=int(size), offset_bytes=int(offset), ref_counter=_b64(ref),
                                 ref_counter_offset=int(ref_offset), event=_b64(event), event_sync=bool(sync),
                                 fence=fence_name)

    def part(self) -> CudaIpcPool:
        return self._part


class OpenedPool:
    """A decode pool opened in this process: [layers, 2, pages, tokens_per_page, Hkv, hd] on its GPU."""

    def __init__(self, part: CudaIpcPool, layout: KVLayout, num_pages: int):
        index = local_index(part.device_uuid)
        dtype = TORCH_DTYPES[layout.dtype]
        shape = (layout.num_layers, 2, num_pages, layout.tokens_per_page, layout.num_kv_heads, layout.head_dim)
        need = layout.num_layers * 2 * num_pages * layout.page_bytes
        if part.storage_bytes < need:
            raise TransferFailed(f"the exported pool holds {part.storage_bytes} bytes; its layout needs {need}")
        event = base64.b64decode(part.event) or None
        storage = torch.UntypedStorage._new_shared_cuda(
            index, base64.b64decode(part.handle), part.storage_bytes, part.offset_bytes,
            base64.b64decode(part.ref_counter), part.ref_counter_offset, event, part.event_sync)
        self.data = torch.empty(0, dtype=dtype, device=f"cuda:{index}").set_(storage, 0, shape)
        self.stream = torch.cuda.Stream(device=index)  # this pool's copies, off the engine's stream
        self.fence_name = part.fence

    def close(self) -> None:
        torch.cuda.synchronize(self.data.device)
        del self.data


class CudaIpcWriter(ShmWriter):
    """A shm writer whose copies go device to device on the pool's copy stream (see the module doc)."""

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, runs: list) -> None:
        ready = None
        if k.is_cuda:  # the copy stream must not read K/V before the engine's stream has written them
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(k.device))
        self.pending.append(self.sender.pool.submit(self._copy_on_stream, layer, k, v, runs, ready))

    def _copy_on_stream(self, layer: int, k: torch.Tensor, v: torch.Tensor, runs: list, ready) -> None:
        if self.state is not TransferState.WRITING:
            return
        m = self.mapped
        try:
            with self.guard.hold(self.dest.slot, self.dest.epoch), torch.inference_mode(), torch.cuda.stream(m.stream):
                if ready is not None:
                    m.stream.wait_event(ready)
                copy_into_pages(m.data[layer, 0], runs, k)
                copy_into_pages(m.data[layer, 1], runs, v)
                landed = torch.cuda.Event()
                landed.record(m.stream)
                landed.synchronize()  # in the pool before the fence lock drops: a revoke never finds it in flight
        except TandemError as e:  # LeaseLost: revoked while we computed; not one byte of this layer landed
            self.fail(e)
            return
        except RuntimeError as e:  # a CUDA error (the peer's memory is gone, ...)
            self.fail(TransferFailed(f"request {self.request_id}: cuda_ipc copy failed: {e}"))
            return
        self.bytes_written += 2 * k.numel() * m.data.element_size()


class CudaIpcSender(KVSender):
    name = NAME

    def __init__(self, layout: KVLayout, registry: dict | None = None, device: str = "cpu"):
        super().__init__(layout)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-cuda-ipc")
        self.opened: dict[str, OpenedPool] = {}  # by the export's handle

    def writer(self, dest: Destination, request_id: str) -> CudaIpcWriter:
        part = self.check(dest)
        if part.handle not in self.opened:
            self._drop_stale()
            try:
                self.opened[part.handle] = OpenedPool(part, dest.pool.layout, dest.pool.num_pages)
            except (RuntimeError, ValueError) as e:
                raise TransferFailed(f"cannot open the decode pool's CUDA IPC handle: {e} (is the decode worker "
                                     f"running on this host?)") from None
        return CudaIpcWriter(self, self.opened[part.handle], request_id, dest, self.layout)

    def _drop_stale(self) -> None:
        """Close pools whose decode worker is gone (its fence table, beside the pool, is removed with it)."""
        for handle in [h for h, o in self.opened.items() if not os.path.exists(os.path.join(SHM_DIR, o.fence_name))]:
            self.opened.pop(handle).close()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for o in self.opened.values():
            o.close()
        self.opened.clear()
