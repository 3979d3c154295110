"""One conformance suite that every KV transport passes (inproc, shm, nixl)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.transports import TransferError, sender
from engine.transports.base import TransferState
from tests.transports.conftest import PEER
from tests.transports.peer import LAYOUT, layer_data


def expected_pages(seed: int, tokens: int) -> torch.Tensor:
    """What the destination pages must hold: [layers, 2, pages, tpp, Hkv, hd], zero past the tokens."""
    n = LAYOUT.pages_for(tokens)
    out = torch.zeros(LAYOUT.num_layers, 2, n * LAYOUT.tokens_per_page, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    for layer in range(LAYOUT.num_layers):
        k, v = layer_data(seed, layer, tokens)
        out[layer, 0, :tokens], out[layer, 1, :tokens] = k, v
    return out.view(LAYOUT.num_layers, 2, n, LAYOUT.tokens_per_page, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def write_all(s, pool, rid: str, pages: list[int], seed: int, tokens: int):
    w = s.writer(pool.descriptor, rid, pages)
    for layer in range(LAYOUT.num_layers):
        w.write_layer(layer, *layer_data(seed, layer, tokens))
    w.finish()
    return w


def wait_for(pool, rid: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = pool.poll()
        if rid in done:
            return done
        time.sleep(0.005)
    return pool.poll()


def test_pages_land_in_order_and_exactly(transport, pool, kv_sender):
    pages = [7, 2, 19]  # scattered, not ascending: token order must follow the page table
    w = write_all(kv_sender, pool, "req-a", pages, seed=1, tokens=10)
    assert w.state is TransferState.DONE
    assert w.bytes_written == 2 * LAYOUT.num_layers * 10 * LAYOUT.num_kv_heads * LAYOUT.head_dim * 4
    if transport != "shm":  # notifying transports: the notice arrives, and only after all the data
        done = wait_for(pool, "req-a")
        assert done["req-a"] == pytest.approx(float(expected_pages(1, 10).abs().sum()), rel=1e-5)
    assert torch.equal(pool.pages(pages), expected_pages(1, 10))


def test_concurrent_writers_into_disjoint_pages(transport, pool, kv_sender):
    s2 = sender(transport, LAYOUT, getattr(pool, "registry", None))
    jobs = [(kv_sender, "req-1", [0, 1, 2], 11, 12), (s2, "req-2", [3, 4], 12, 7)]
    errors = []

    def run(job):
        try:
            write_all(job[0], pool, *job[1:])
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s2.close()
    assert not errors
    for _, rid, pages, seed, tokens in jobs:
        assert torch.equal(pool.pages(pages), expected_pages(seed, tokens)), rid
    if transport != "shm":
        assert {"req-1", "req-2"} <= set(wait_for(pool, "req-2"))


def test_abort_sends_no_completion(transport, pool, kv_sender):
    w = kv_sender.writer(pool.descriptor, "req-x", [5, 6])
    w.write_layer(0, *layer_data(3, 0, 6))
    w.abort()
    assert w.state is TransferState.ABORTED
    w.finish()
    assert w.state is TransferState.ABORTED
    with pytest.raises(TransferError, match="aborted"):
        w.write_layer(1, *layer_data(3, 1, 6))
    time.sleep(0.2)
    assert "req-x" not in pool.poll()


def test_a_writer_crashing_halfway_never_completes(transport, pool):
    if transport == "inproc":
        pytest.skip("a crash needs a writer process")
    proc = subprocess.Popen([sys.executable, PEER, "write", transport], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    proc.communicate(json.dumps({"pool": pool.descriptor, "request_id": "req-crash", "pages": [8, 9],
                                 "seed": 4, "tokens": 8, "crash_after": 2}) + "\n", timeout=60)
    assert proc.returncode == 17
    time.sleep(0.3)
    assert "req-crash" not in pool.poll()  # the decode side must time the lease out (tested in decode worker)
    # the pool still serves other writers afterwards
    proc = subprocess.run([sys.executable, PEER, "write", transport], input=json.dumps(
        {"pool": pool.descriptor, "request_id": "req-ok", "pages": [10], "seed": 5, "tokens": 3}) + "\n",
        capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout)["state"] == "done", proc.stderr[-2000:]
    assert torch.equal(pool.pages([10]), expected_pages(5, 3))


def test_pages_outside_the_pool_are_refused(pool, kv_sender):
    with pytest.raises(TransferError, match="not distinct pages of a pool with 24 pages"):
        kv_sender.writer(pool.descriptor, "r", [3, 99])
    with pytest.raises(TransferError, match="not distinct"):
        kv_sender.writer(pool.descriptor, "r", [3, 3])
    w = kv_sender.writer(pool.descriptor, "r", [3])
    with pytest.raises(TransferError, match="10 tokens need 3 pages, destination has 1"):
        w.write_layer(0, *layer_data(1, 0, 10))


def test_a_pool_that_does_not_exist_is_refused(transport, pool, kv_sender):
    bad = dict(pool.descriptor)
    key = {"shm": "segment", "inproc": "id", "nixl": "metadata"}[transport]
    bad[key] = "tandem-no-such-pool" if transport != "nixl" else "bm90IG1ldGFkYXRh"
    if transport == "nixl":
        bad["agent"] = "decode-nobody"
    with pytest.raises(TransferError):
        kv_sender.writer(bad, "r", [1])


def test_a_pool_with_another_layout_is_refused(pool, kv_sender):
    bad = dict(pool.descriptor, layout=dict(pool.descriptor["layout"], head_dim=16))
    with pytest.raises(TransferError, match="'head_dim': prefill has 8, decode has 16"):
        kv_sender.writer(bad, "r", [1])
