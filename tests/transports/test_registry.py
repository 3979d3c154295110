"""The transport registry: one exception for a transport that is unknown or cannot be used here, and the
CUDA IPC part of a pool descriptor crossing the control channel as typed JSON (no pickle)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.kv_pool import KVCache
from engine.transports import TRANSPORTS, TransportUnavailable, endpoint, sender
from engine.transports.host import PoolHost
from tandem.pool import CudaIpcPool, PoolDescriptor
from tandem.status import Status, TransferFailed, status_of
from tandem.wire import WireError, parse
from tests.transports.peer import LAYOUT, NUM_PAGES


def test_every_transport_is_in_the_registry():
    assert set(TRANSPORTS) == {"shm", "cuda_ipc", "nixl", "inproc"}


def test_an_unknown_transport_is_refused_naming_the_allowed_ones():
    with pytest.raises(TransportUnavailable, match="unknown transport 'rdma'; allowed: shm, cuda_ipc, nixl, inproc"):
        sender("rdma", LAYOUT)
    cache = KVCache(LAYOUT, NUM_PAGES)
    with pytest.raises(TransportUnavailable, match="unknown transport 'rdma'"):
        endpoint("rdma", cache, "tandem-fence-none")
    assert issubclass(TransportUnavailable, TransferFailed)  # a writer's failure: retried elsewhere, typed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a machine without CUDA")
def test_cuda_ipc_without_cuda_is_unavailable_on_both_sides():
    with pytest.raises(TransportUnavailable, match="transport cuda_ipc cannot be used here: no CUDA device"):
        sender("cuda_ipc", LAYOUT)
    cache = KVCache(LAYOUT, NUM_PAGES)
    with pytest.raises(TransportUnavailable, match="no CUDA device"):
        PoolHost(cache, ("cuda_ipc",))  # a decode worker cannot offer it either; its fence table is removed
    assert status_of(TransportUnavailable("x")) is Status.TRANSFER_FAILED


def test_a_gpu_pool_descriptor_crosses_the_wire_as_json():
    part = CudaIpcPool(device_uuid="GPU-0f0f", handle="aGFuZGxl", storage_bytes=4096, offset_bytes=512,
                       ref_counter="L3RvcmNoXzE=", ref_counter_offset=3, event="", event_sync=False,
                       fence="tandem-fence-1")
    d = PoolDescriptor(layout=LAYOUT, num_pages=NUM_PAGES, num_slots=NUM_PAGES, host="h", cuda_ipc=part)
    raw = json.dumps(dataclasses.asdict(d))
    back = parse(PoolDescriptor, raw)
    assert back == d and back.transports == ("cuda_ipc",)
    bad = json.loads(raw)
    bad["cuda_ipc"]["handle"] = 7
    with pytest.raises(WireError, match="CudaIpcPool.handle: expected str, got int"):
        parse(PoolDescriptor, bad)


def test_a_pull_source_in_gpu_memory_crosses_the_wire_as_json():
    """The pull descriptor of a prefill pool exported by CUDA IPC (and to NIXL readers, fence table and
    all) travels as typed JSON inside Prefilled and Open, and a malformed one is refused by field."""
    from tandem.pool import NixlPool, PullSource
    from tandem.sampling_params import SamplingParams
    from tandem.wire import Open

    ipc = CudaIpcPool(device_uuid="GPU-0f0f", handle="aGFuZGxl", storage_bytes=4096, offset_bytes=0,
                      ref_counter="L3RvcmNoXzE=", ref_counter_offset=0, event="", event_sync=False,
                      fence="tandem-fence-2")
    nixl = NixlPool(agent="pool-1", metadata="bWV0YQ==", base=1 << 20, bytes=4096, memory="VRAM", device_id=1,
                    fence_base=2 << 20)
    pool = PoolDescriptor(layout=LAYOUT, num_pages=NUM_PAGES, num_slots=NUM_PAGES, host="h", cuda_ipc=ipc, nixl=nixl)
    src = PullSource("r", "0123abcd", "cuda_ipc", pool, [3, 1], 7, 2, 9, 42, -0.5)
    msg = Open("r", [1] * 7, SamplingParams(max_tokens=4), source=src)
    raw = json.loads(json.dumps(dataclasses.asdict(msg)))
    assert parse(Open, raw) == msg and parse(Open, raw).source.pool.transports == ("cuda_ipc", "nixl")
    raw["source"]["pool"]["nixl"]["fence_base"] = "0x200000"
    with pytest.raises(WireError, match="NixlPool.fence_base: expected int, got str"):
        parse(Open, raw)
