"""The pull handoff's read side: one conformance suite for every transport that can be read from
(shm and nixl: the source pool in another process; inproc; cuda_ipc and nixl-vram on a GPU). The source
pool is filled through the push side (whose own suite proves it exact), then read into a local pool the
way a decode worker pulls."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine.kv_pool import KVCache
from engine.transports import sender
from engine.transports.pull import reader
from tandem.pool import PullSource
from tandem.status import LeaseLost, TransferFailed
from tests.transports.conftest import _NO_NIXL, LocalPool, RemotePool
from tests.transports.peer import LAYOUT, NUM_PAGES, device_of, transport_name
from tests.transports.test_conformance import expected_pages, write_all

SOURCES = ["inproc", "shm", pytest.param("nixl", marks=_NO_NIXL), pytest.param("cuda_ipc", marks=pytest.mark.gpu),
           pytest.param("nixl-vram", marks=[pytest.mark.gpu, _NO_NIXL])]


@pytest.fixture(params=SOURCES)
def source_pool(request):
    p = LocalPool() if request.param == "inproc" else RemotePool(request.param)
    yield p
    p.close()


@pytest.fixture
def kv_reader(source_pool):
    r = reader(source_pool.transport, LAYOUT, getattr(source_pool, "registry", None))
    yield r
    r.close()


def local_pool(source_pool) -> KVCache:
    """The reader's own pool: on the GPU where the source is (GPU transports), else in host memory."""
    return KVCache(LAYOUT, NUM_PAGES, device=device_of(getattr(source_pool, "kind", "inproc")))


def held(pool, pages: list[int], seed: int, tokens: int) -> PullSource:
    """K/V of `tokens` positions written into `pages` of the source pool, held under a fresh fence slot."""
    device = device_of(getattr(pool, "kind", "inproc"))
    s = sender(pool.transport, LAYOUT, getattr(pool, "registry", None), device)
    try:
        dest = pool.destination(pages)
        write_all(s, dest, f"fill-{seed}", seed, tokens, device)
    finally:
        s.close()
    return PullSource(f"req-{seed}", "hold", pool.transport, dest.pool, pages, tokens, dest.slot, dest.epoch, 1)


def test_a_read_lands_in_order_and_exactly(source_pool, kv_reader):
    src = held(source_pool, [7, 2, 19], seed=1, tokens=10)
    local = local_pool(source_pool)
    n = kv_reader.read(src, local, [4, 11, 0])  # other page ids than the source's: token order follows each table
    assert n == 3 * LAYOUT.tokens_per_page * LAYOUT.bytes_per_token
    got = local.data[:, :, [4, 11, 0]].cpu()
    want = expected_pages(1, 10)
    assert torch.equal(got.flatten(2, 3)[:, :, :10], want.flatten(2, 3)[:, :, :10])


def test_positions_the_reader_holds_are_not_read(source_pool, kv_reader):
    src = held(source_pool, [5, 6, 8], seed=2, tokens=12)
    local = local_pool(source_pool)
    n = kv_reader.read(src, local, [1, 2, 3], start=LAYOUT.tokens_per_page)  # page 1 is in its own cache
    assert n == 2 * LAYOUT.tokens_per_page * LAYOUT.bytes_per_token
    assert not local.data[:, :, 1].any()
    assert torch.equal(local.data[:, :, [2, 3]].cpu(), expected_pages(2, 12)[:, :, 1:])
    with pytest.raises(TransferFailed, match="page boundary"):
        kv_reader.read(src, local, [1, 2, 3], start=1)


def test_a_revoked_hold_gives_no_read(source_pool, kv_reader):
    """The fence mirrored: once the source side revokes the slot, a read fails LEASE_LOST having read
    nothing (NIXL: the reader READs the slot's epoch first, and tells the pool its reads ended)."""
    src = held(source_pool, [9, 10], seed=3, tokens=8)
    assert source_pool.revoke(src.slot)
    local = local_pool(source_pool)
    with pytest.raises(LeaseLost, match="revoked|hold on the source pages ended"):
        kv_reader.read(src, local, [9, 10])
    assert not local.data.any()
    if transport_name(getattr(source_pool, "kind", "inproc")) == "nixl":
        assert [src.slot, src.epoch] in wait_closed(source_pool, src)


def wait_closed(pool, src: PullSource, timeout: float = 10.0) -> list:
    """The (slot, epoch) pairs the pool heard `closed` for, once src's is among them (or the time is up)."""
    deadline = time.monotonic() + timeout
    while [src.slot, src.epoch] not in (closed := pool.poll()["closed"]) and time.monotonic() < deadline:
        time.sleep(0.005)
    return closed


def test_a_stopped_read_stops_between_layers(source_pool, kv_reader):
    """Fenced readers stop between layers; a NIXL reader reads in one transfer and stops before it."""
    src = held(source_pool, [12], seed=4, tokens=3)
    local = local_pool(source_pool)
    calls = []

    def stopped() -> bool:  # false before layer 0, true before layer 1
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(Exception, match="stopped"):
        kv_reader.read(src, local, [12], stopped=stopped)
        kv_reader.read(src, local, [12], stopped=stopped)  # a one-transfer reader read it all the first time
    if kv_reader.name == "nixl":
        assert torch.equal(local.data[:, :, 12].cpu(), expected_pages(4, 3)[:, :, 0])
    else:
        assert local.data[0, :, 12].any() and not local.data[1:].any()


def test_bad_sources_are_refused_without_echoing_them(source_pool, kv_reader):
    src = held(source_pool, [3, 4], seed=5, tokens=8)
    local = local_pool(source_pool)
    for bad in (dataclasses.replace(src, page_ids=[3, 99]), dataclasses.replace(src, page_ids=[3]),
                dataclasses.replace(src, pool=dataclasses.replace(src.pool, layout=dataclasses.replace(
                    src.pool.layout, head_dim=16)))):
        with pytest.raises(TransferFailed) as e:
            kv_reader.read(bad, local, [3, 4])
        assert "segment" not in str(e.value) and "metadata" not in str(e.value)
    with pytest.raises(TransferFailed, match="need 2 pages, the destination has 1"):
        kv_reader.read(src, local, [3])
    assert not local.data.any()


def test_an_unknown_read_side_or_one_that_cannot_run_here_is_refused():
    with pytest.raises(TransferFailed, match="unknown transport 'carrier-pigeon'; the pull handoff reads over shm, "
                                             "cuda_ipc, nixl, inproc"):
        reader("carrier-pigeon", LAYOUT)
    if not torch.cuda.is_available():
        with pytest.raises(TransferFailed, match="cannot read over cuda_ipc here: no CUDA device"):
            reader("cuda_ipc", LAYOUT)
