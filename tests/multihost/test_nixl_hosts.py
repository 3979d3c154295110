"""NIXL (UCX over TCP) between two namespace hosts with the project's transport: the KV pages a writer
in host B sends land exactly in the pool of host A (push), and a reader in host B reads the pages a
prefill pool in host A holds exactly (pull, NIXL READ); GB/s printed next to a plain TCP stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from engine.transports.nixl import available as nixl_available
from tests.multihost.link import tcp_throughput
from tests.multihost.nixl_peer import LAYOUT, NUM_PAGES

PEER = os.path.join(os.path.dirname(__file__), "nixl_peer.py")
UCX_PORTS = (20000, 20099)
pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed (pip install --no-deps nixl-cu12)")


def ucx_env(host) -> dict[str, str]:
    """What a process needs for UCX across hosts: TCP (plus self for loopback to itself) on the host's
    own interface. Without UCX_NET_DEVICES the transport defaults to `lo`, unreachable from a peer.
    TANDEM_TEST_UCX_TLS tries another transport list (docs/deploy.md records what was seen).
    UCX_TCP_PORT_RANGE pins UCX's TCP listeners, as a NetworkPolicy or firewall needs."""
    return {"UCX_TLS": os.environ.get("TANDEM_TEST_UCX_TLS", "tcp,self"), "UCX_NET_DEVICES": host.device,
            "UCX_TCP_PORT_RANGE": f"{UCX_PORTS[0]}-{UCX_PORTS[1]}"}


def tcp_sockets(host, pid: int) -> tuple[set[int], list[tuple[int, int]]]:
    """Listening ports and (local, peer) ports of established connections of process pid in host."""
    def rows(*flags):
        out = host.run(["ss", "-Htnp", *flags]).stdout.splitlines()
        return [r.split() for r in out if f"pid={pid}," in r]
    port = lambda addr: int(addr.rsplit(":", 1)[1])  # noqa: E731
    listening = {port(r[3]) for r in rows("-l")}
    established = [(port(r[2]), port(r[3])) for r in rows("state", "established")]  # no State column here
    return listening, established


def ask(proc, cmd: dict) -> dict:
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"peer exited with {proc.wait()}"
    return json.loads(line)


def test_nixl_write_lands_exactly_across_hosts(two_hosts):
    a, b = two_hosts
    pool = a.popen([sys.executable, PEER, "pool"], env=ucx_env(a), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                   text=True)
    line = pool.stdout.readline()
    assert line, f"pool process exited with {pool.wait()}"
    nixl = json.loads(line)["nixl"]
    tokens = 4000
    pages = list(range(NUM_PAGES - 1, NUM_PAGES - 1 - LAYOUT.pages_for(tokens), -1))  # descending: order matters
    job = {"nixl": nixl, "request_id": "req-x", "pages": pages, "seed": 7, "tokens": tokens}
    writer = b.popen([sys.executable, PEER, "write"], env=ucx_env(b), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     text=True)
    writer.stdin.write(json.dumps(job) + "\n")
    writer.stdin.flush()
    line = writer.stdout.readline()
    assert line, f"writer exited with {writer.wait()}"
    sent = json.loads(line)
    in_range = lambda p: UCX_PORTS[0] <= p <= UCX_PORTS[1]  # noqa: E731
    listening, established = tcp_sockets(a, pool.pid)
    assert listening and all(in_range(p) for p in listening), listening
    # Every connection has one end on a pinned listener (the writer dials the pool's), so a policy that
    # opens only the range between the two roles lets the handoff through.
    assert established and all(in_range(l) or in_range(r) for l, r in established), established
    print(f"\npool listens on {sorted(listening)}; connections (local, peer): {sorted(established)}")
    arrived = ask(pool, {"cmd": "wait", **{k: job[k] for k in ("request_id", "pages", "seed", "tokens")}})
    for proc in (writer, pool):
        proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    assert arrived == {"ready": True, "exact": True}
    assert sent["bytes"] == tokens * LAYOUT.bytes_per_token
    tcp = tcp_throughput(a, b, nbytes=sent["bytes"])
    print(f"\nNIXL/UCX tcp {b.device} -> {a.device}: {sent['bytes'] / 2**20:.0f} MiB in {sent['seconds']:.3f} s = "
          f"{sent['bytes'] / sent['seconds'] / 1e9:.2f} GB/s; plain TCP, same bytes: {tcp.gbps:.2f} GB/s")


def test_a_nixl_read_pulls_held_pages_exactly_across_hosts(two_hosts):
    """The pull handoff across hosts: host A holds K/V in a pool exported as a prefill worker exports it;
    the reader in host B READs the hold's fence word, then the pages, and tells A its reads ended."""
    a, b = two_hosts
    source = a.popen([sys.executable, PEER, "source"], env=ucx_env(a), stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, text=True)
    tokens = 4000
    held_pages = list(range(LAYOUT.pages_for(tokens)))
    held = ask(source, {"cmd": "hold", "pages": held_pages, "seed": 9, "tokens": tokens})["source"]
    mine = list(range(NUM_PAGES - 1, NUM_PAGES - 1 - len(held_pages), -1))  # another order: the table is followed
    reader = b.popen([sys.executable, PEER, "read"], env=ucx_env(b), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     text=True)
    got = ask(reader, {"source": held, "pages": mine, "seed": 9})
    assert reader.wait(timeout=30) == 0
    closed = []
    for _ in range(200):  # the reader's `closed` notice travels after its READs completed
        if [held["slot"], held["epoch"]] in (closed := ask(source, {"cmd": "closed"})["closed"]):
            break
        time.sleep(0.05)
    source.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
    source.stdin.flush()
    assert source.wait(timeout=30) == 0
    assert got["exact"] and got["bytes"] == len(held_pages) * LAYOUT.tokens_per_page * LAYOUT.bytes_per_token
    assert [held["slot"], held["epoch"]] in closed
    print(f"\nNIXL READ across hosts: {got['bytes'] / got['seconds'] / 1e9:.2f} GB/s")
