"""The pull handoff's read side: one conformance suite for every transport that can be read from
(shm: the source pool in another process; inproc). The source pool is filled through the push side
(whose own suite proves it exact), then read into a local pool the way a decode worker pulls."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv_pool import KVCache
from engine.transports import sender
from engine.transports.pull import reader
from tandem.pool import PullSource
from tandem.status import LeaseLost, TransferFailed
from tests.transports.conftest import LocalPool, RemotePool
from tests.transports.peer import LAYOUT, NUM_PAGES
from tests.transports.test_conformance import expected_pages, write_all


@pytest.fixture(params=["inproc", "shm"])
def source_pool(request):
    p = LocalPool() if request.param == "inproc" else RemotePool(request.param)
    yield p
    p.close()


@pytest.fixture
def kv_reader(source_pool):
    r = reader(source_pool.transport, LAYOUT, getattr(source_pool, "registry", None))
    yield r
    r.close()


def held(pool, pages: list[int], seed: int, tokens: int) -> PullSource:
    """K/V of `tokens` positions written into `pages` of the source pool, held under a fresh fence slot."""
    s = sender(pool.transport, LAYOUT, getattr(pool, "registry", None))
    try:
        dest = pool.destination(pages)
        write_all(s, dest, f"fill-{seed}", seed, tokens)
    finally:
        s.close()
    return PullSource(f"req-{seed}", "hold", pool.transport, dest.pool, pages, tokens, dest.slot, dest.epoch, 1)


def test_a_read_lands_in_order_and_exactly(source_pool, kv_reader):
    src = held(source_pool, [7, 2, 19], seed=1, tokens=10)
    local = KVCache(LAYOUT, NUM_PAGES)
    n = kv_reader.read(src, local, [4, 11, 0])  # other page ids than the source's: token order follows each table
    assert n == 3 * LAYOUT.tokens_per_page * LAYOUT.bytes_per_token
    got = local.data[:, :, [4, 11, 0]]
    want = expected_pages(1, 10)
    assert torch.equal(got.flatten(2, 3)[:, :, :10], want.flatten(2, 3)[:, :, :10])


def test_positions_the_reader_holds_are_not_read(source_pool, kv_reader):
    src = held(source_pool, [5, 6, 8], seed=2, tokens=12)
    local = KVCache(LAYOUT, NUM_PAGES)
    n = kv_reader.read(src, local, [1, 2, 3], start=LAYOUT.tokens_per_page)  # page 1 is in its own cache
    assert n == 2 * LAYOUT.tokens_per_page * LAYOUT.bytes_per_token
    assert not local.data[:, :, 1].any()
    assert torch.equal(local.data[:, :, [2, 3]], expected_pages(2, 12)[:, :, 1:])
    with pytest.raises(TransferFailed, match="page boundary"):
        kv_reader.read(src, local, [1, 2, 3], start=1)


def test_a_revoked_hold_gives_no_read(source_pool, kv_reader):
    """The fence mirrored: once the source side revokes the slot, a read fails LEASE_LOST having read nothing."""
    src = held(source_pool, [9, 10], seed=3, tokens=8)
    assert source_pool.revoke(src.slot)
    local = KVCache(LAYOUT, NUM_PAGES)
    with pytest.raises(LeaseLost, match="revoked"):
        kv_reader.read(src, local, [9, 10])
    assert not local.data.any()


def test_a_stopped_read_stops_between_layers(source_pool, kv_reader):
    src = held(source_pool, [12], seed=4, tokens=3)
    local = KVCache(LAYOUT, NUM_PAGES)
    calls = []

    def stopped() -> bool:  # false before layer 0, true before layer 1
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(Exception, match="stopped"):
        kv_reader.read(src, local, [12], stopped=stopped)
    assert local.data[0, :, 12].any() and not local.data[1:].any()


def test_bad_sources_are_refused_without_echoing_them(source_pool, kv_reader):
    src = held(source_pool, [3, 4], seed=5, tokens=8)
    local = KVCache(LAYOUT, NUM_PAGES)
    for bad in (dataclasses.replace(src, page_ids=[3, 99]), dataclasses.replace(src, page_ids=[3]),
                dataclasses.replace(src, pool=dataclasses.replace(src.pool, layout=dataclasses.replace(
                    src.pool.layout, head_dim=16)))):
        with pytest.raises(TransferFailed) as e:
            kv_reader.read(bad, local, [3, 4])
        assert "segment" not in str(e.value) and "metadata" not in str(e.value)
    with pytest.raises(TransferFailed, match="need 2 pages, the destination has 1"):
        kv_reader.read(src, local, [3])
    assert not local.data.any()


def test_a_transport_without_a_read_side_says_so():
    with pytest.raises(TransferFailed, match="no NIXL READ side yet"):
        reader("nixl", LAYOUT)
    with pytest.raises(TransferFailed, match="unknown transport"):
        reader("carrier-pigeon", LAYOUT)
