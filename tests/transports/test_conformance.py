"""One conformance suite that every KV transport passes (inproc, shm, nixl; cuda_ipc and nixl-vram on a GPU)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.transports import sender
from engine.transports.base import TransferState
from tandem.status import LeaseLost, TransferFailed
from tests.transports.conftest import PEER
from tests.transports.peer import LAYOUT, layer_data, transport_name


def notifies(kind: str) -> bool:
    """Transports whose decode side learns of a finished request by a notice (the others by the reply)."""
    return transport_name(kind) in ("nixl", "inproc")


def expected_pages(seed: int, tokens: int, start: int = 0) -> torch.Tensor:
    """What the destination pages must hold: [layers, 2, pages, tpp, Hkv, hd], zero outside [start, tokens)."""
    n = LAYOUT.pages_for(tokens)
    out = torch.zeros(LAYOUT.num_layers, 2, n * LAYOUT.tokens_per_page, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    for layer in range(LAYOUT.num_layers):
        k, v = layer_data(seed, layer, tokens)
        out[layer, 0, start:tokens], out[layer, 1, start:tokens] = k[start:], v[start:]
    return out.view(LAYOUT.num_layers, 2, n, LAYOUT.tokens_per_page, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def write_all(s, dest, rid: str, seed: int, tokens: int, device: str = "cpu"):
    w = s.writer(dest, rid)
    for layer in range(LAYOUT.num_layers):
        w.write_layer(layer, *(x.to(device) for x in layer_data(seed, layer, tokens)))
    w.finish()
    return w


def wait_for(pool, rid: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = pool.poll()
        if rid in done["done"]:
            return done
        time.sleep(0.005)
    return pool.poll()


def test_pages_land_in_order_and_exactly(transport, pool, kv_sender, kv_device):
    pages = [7, 2, 19]  # scattered, not ascending: token order must follow the page table
    w = write_all(kv_sender, pool.destination(pages), "req-a", seed=1, tokens=10, device=kv_device)
    assert w.state is TransferState.DONE
    assert w.bytes_written == 2 * LAYOUT.num_layers * 10 * LAYOUT.num_kv_heads * LAYOUT.head_dim * 4
    if notifies(transport):  # notifying transports: the notice arrives, and only after all the data
        done = wait_for(pool, "req-a")["done"]
        assert done["req-a"] == pytest.approx(float(expected_pages(1, 10).abs().sum()), rel=1e-5)
    assert torch.equal(pool.pages(pages), expected_pages(1, 10))


def test_positions_before_the_destination_start_are_skipped(pool, kv_sender, kv_device):
    """A decode worker that already holds a prefix (start) gets only the rest."""
    pages = [4, 5, 6]
    write_all(kv_sender, pool.destination(pages, start=LAYOUT.tokens_per_page), "req-s", seed=2, tokens=10,
              device=kv_device)
    assert torch.equal(pool.pages(pages), expected_pages(2, 10, start=LAYOUT.tokens_per_page))


def test_concurrent_writers_into_disjoint_pages(transport, pool, kv_sender, kv_device):
    s2 = sender(transport_name(transport), LAYOUT, getattr(pool, "registry", None), kv_device)
    jobs = [(kv_sender, pool.destination([0, 1, 2]), "req-1", 11, 12, kv_device),
            (s2, pool.destination([3, 4]), "req-2", 12, 7, kv_device)]
    errors = []

    def run(job):
        try:
            write_all(*job)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s2.close()
    assert not errors
    for _, dest, rid, seed, tokens, _ in jobs:
        assert torch.equal(pool.pages(dest.page_ids), expected_pages(seed, tokens)), rid
    if notifies(transport):
        assert {"req-1", "req-2"} <= set(wait_for(pool, "req-2")["done"])


def test_abort_sends_no_completion_and_closes_the_writer(transport, pool, kv_sender):
    dest = pool.destination([5, 6])
    w = kv_sender.writer(dest, "req-x")
    w.write_layer(0, *layer_data(3, 0, 6))
    w.abort()
    assert w.state is TransferState.ABORTED
    before = pool.pages([5, 6]).clone()
    w.write_layer(1, *layer_data(3, 1, 6))  # a stopped writer writes nothing more
    time.sleep(0.2)
    polled = pool.poll()
    assert "req-x" not in polled["done"]
    assert torch.equal(pool.pages([5, 6]), before)
    if transport_name(transport) == "nixl":  # the NIXL fence: the decode side learns that this writer is closed
        deadline = time.monotonic() + 5
        while [dest.slot, dest.epoch] not in polled["closed"] and time.monotonic() < deadline:
            polled = pool.poll()
        assert [dest.slot, dest.epoch] in polled["closed"]


def test_a_revoked_lease_gets_no_write(transport, pool, kv_sender):
    """The strict fence (shm, cuda_ipc, inproc): after the decode side revokes the slot, nothing lands, and
    the writer says LEASE_LOST. NIXL writes one-sided and is fenced by its close notice instead."""
    if transport_name(transport) == "nixl":
        pytest.skip("NIXL's fence is the writer's close notice (test_abort_sends_no_completion...)")
    dest = pool.destination([8, 9])
    w = kv_sender.writer(dest, "req-r")
    w.write_layer(0, *layer_data(6, 0, 8))
    assert pool.revoke(dest.slot)
    w.write_layer(1, *layer_data(6, 1, 8))
    with pytest.raises(LeaseLost, match="revoked"):
        w.finish()
    got = pool.pages([8, 9])
    want = expected_pages(6, 8)
    assert torch.equal(got[0], want[0]) and not got[1].any()  # layer 0 before the revoke, layer 1 never


def test_a_writer_crashing_halfway_never_completes(transport, pool):
    if transport == "inproc":
        pytest.skip("a crash needs a writer process")
    dest = dataclasses.asdict(pool.destination([8, 9]))
    proc = subprocess.Popen([sys.executable, PEER, "write", transport], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    proc.communicate(json.dumps({"destination": dest, "request_id": "req-crash", "seed": 4, "tokens": 8,
                                 "crash_after": 2}) + "\n", timeout=60)
    assert proc.returncode == 17
    time.sleep(0.3)
    assert "req-crash" not in pool.poll()["done"]  # the decode side times the lease out (decode worker tests)
    # the pool still serves other writers afterwards
    proc = subprocess.run([sys.executable, PEER, "write", transport], input=json.dumps(
        {"destination": dataclasses.asdict(pool.destination([10])), "request_id": "req-ok", "seed": 5,
         "tokens": 3}) + "\n", capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout)["state"] == "done", proc.stderr[-2000:]
    assert torch.equal(pool.pages([10]), expected_pages(5, 3))


def test_pages_outside_the_pool_are_refused(pool, kv_sender):
    with pytest.raises(TransferFailed, match="distinct pages of a pool with 24 pages"):
        kv_sender.writer(pool.destination([3, 99]), "r")
    with pytest.raises(TransferFailed, match="distinct"):
        kv_sender.writer(pool.destination([3, 3]), "r")
    w = kv_sender.writer(pool.destination([3]), "r")
    w.write_layer(0, *layer_data(1, 0, 10))  # never raises: the failure is recorded ...
    with pytest.raises(TransferFailed, match="10 tokens need 3 pages, destination has 1"):
        w.finish()  # ... and raised here


def test_a_pool_that_does_not_exist_is_refused(transport, pool, kv_sender):
    dest = pool.destination([1])
    d = dest.pool
    part = {"shm": lambda: dataclasses.replace(d.shm, segment="tandem-no-such-pool"),
            "inproc": lambda: dataclasses.replace(d.inproc, id="no-such-pool"),
            "nixl": lambda: dataclasses.replace(d.nixl, agent="decode-nobody", metadata="bm90IG1ldGFkYXRh"),
            "cuda_ipc": lambda: dataclasses.replace(d.cuda_ipc, handle="bm90IGEgaGFuZGxl")}
    name = transport_name(transport)
    bad = dataclasses.replace(dest, pool=dataclasses.replace(d, **{name: part[name]()}))
    with pytest.raises(TransferFailed):
        kv_sender.writer(bad, "r")


def test_a_pool_with_another_layout_is_refused(pool, kv_sender):
    dest = pool.destination([1])
    bad = dataclasses.replace(dest, pool=dataclasses.replace(dest.pool, layout=dataclasses.replace(
        dest.pool.layout, head_dim=16)))
    with pytest.raises(TransferFailed, match="'head_dim': prefill has 8, decode has 16"):
        kv_sender.writer(bad, "r")
