"""Where a request's K/V go: the typed descriptor of a worker's KV pool, a destination in it (push),
and a source in it (pull: K/V held in the prefill worker's pool for the decode worker to read).

A decode worker publishes one `PoolDescriptor`; it names every transport the pool can be reached by
(`shm` or `cuda_ipc` on its own host, for a pool in host or GPU memory; `nixl` from anywhere UCX reaches)
and the host it lives on, so a prefill worker picks per pair: the one-host transport when both are on
one host, NIXL otherwise (or what the deployment forces).
The NIXL and CUDA IPC parts are access keys (agent memory keys, an IPC memory handle): whoever has one
can write the pool, so a descriptor only ever travels on the control channel and is never echoed in an
error message.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from tandem.kv_layout import KVLayout


@dataclass(frozen=True)
class ShmPool:
    segment: str  # /dev/shm name of the pool: [layers, 2, pages, tokens_per_page, kv_heads, head_dim]
    bytes: int
    fence: str  # /dev/shm name of the fence table (one 8-byte epoch per lease slot; see engine/transports/fence.py)


@dataclass(frozen=True)
class NixlPool:
    agent: str
    metadata: str  # base64 of the agent's metadata (memory keys: never log it)
    base: int  # address of the registered pool in the decode process
    bytes: int
    memory: str = "DRAM"  # NIXL memory type of the pool: DRAM (host) or VRAM (GPU)
    device_id: int = 0  # VRAM: the GPU index in the decode process
    fence_base: int = 0  # address of the pool's fence table (8 bytes a slot, DRAM) there; pull readers READ it


@dataclass(frozen=True)
class CudaIpcPool:
    """A pool in GPU memory, exported by torch's `UntypedStorage._share_cuda_()`; bytes travel as base64."""

    device_uuid: str  # the GPU holding it (device numbering differs between processes; the UUID does not)
    handle: str  # base64 of the cudaIpcMemHandle of the allocation that holds the pool (never log it)
    storage_bytes: int  # size of the pool's storage ...
    offset_bytes: int  # ... and where it starts in that allocation
    ref_counter: str  # base64 of the name of torch's shared reference counter of the export
    ref_counter_offset: int
    event: str  # base64 of the cudaIpcEventHandle torch records with the export ("" when none)
    event_sync: bool  # whether the opener must wait on that event before its first use
    fence: str  # /dev/shm name of the fence table (as ShmPool's: cuda_ipc writers share the decode worker's host)


@dataclass(frozen=True)
class InprocPool:
    id: str  # key of the pool in a registry shared inside one process (tests)


@dataclass(frozen=True)
class PoolDescriptor:
    layout: KVLayout
    num_pages: int
    num_slots: int  # lease slots the fence table has
    host: str  # host_identity() of the decode worker
    shm: ShmPool | None = None
    nixl: NixlPool | None = None
    inproc: InprocPool | None = None
    cuda_ipc: CudaIpcPool | None = None

    @property
    def transports(self) -> tuple[str, ...]:
        return tuple(n for n in ("shm", "cuda_ipc", "nixl", "inproc") if getattr(self, n) is not None)


@dataclass(frozen=True)
class Destination:
    """The pages leased to one request, and the fence that guards them.

    The writer writes token positions [start, num_tokens) of the request into `page_ids` (the whole
    page table; positions before `start` are already there, e.g. a cached prefix; `start` is a
    multiple of tokens_per_page). Every write is checked against `epoch` in lease slot `slot`: once
    the decode worker revokes the slot, no write of this writer can land.
    """

    transport: str  # which of the pool's transports this writer must use (chosen per prefill/decode pair)
    pool: PoolDescriptor
    page_ids: list[int]
    slot: int
    epoch: int
    start: int = 0


@dataclass(frozen=True)
class PullSource:
    """The pull handoff's transfer descriptor: where a prefilled request's K/V wait for its reader.

    Positions [0, tokens) of the request lie in `page_ids` (its whole page table) of the prefill
    worker's exported pool, held there until the hold ends. A reader reads them through `transport`,
    each read checked against `epoch` in fence slot `slot` of the pool's fence table: once the prefill
    worker revokes the slot, no read can see the pages (they may belong to another request by then).
    It also carries the first token, so the decode side can continue from it (TensorRT-LLM's
    DisaggregatedParams carry `first_gen_tokens` the same way). The pool part may hold access keys:
    it travels on the control channel only and is never echoed in an error.
    """

    request_id: str
    hold: str  # the hold's id: Unhold must show it
    transport: str  # shm | cuda_ipc | nixl | inproc: the read side the reader uses (the holder chose it)
    pool: PoolDescriptor  # the prefill worker's exported pool (layout, region, fence table)
    page_ids: list[int]
    tokens: int  # positions whose K/V are in the pages: the prompt plus tokens already sent
    slot: int
    epoch: int
    first_token: int
    first_logprob: float | None = None


def host_identity() -> str:
    """Equal on two processes iff they share a kernel, a /dev/shm and a network namespace.

    The network namespace is part of it so that test "hosts" made of namespaces on one machine (and
    containers) count as different hosts, as they would be in a cluster.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        shm_dev = os.stat("/dev/shm").st_dev
    except OSError:
        shm_dev = 0
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot}/{shm_dev}/{netns}"
