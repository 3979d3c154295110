"""Namespace hosts: reachable from each other on their 198.18 addresses, removed after use, and the
plain-TCP yardstick between them (printed, for the handoff comparison)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.multihost import netns
from tests.multihost.link import tcp_throughput

FETCH = """
import sys, time, urllib.request
deadline = time.monotonic() + 20
while True:
    try:
        print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode()); break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.1)
"""


def test_http_server_in_one_host_is_fetched_from_the_other(two_hosts, tmp_path):
    a, b = two_hosts
    assert a.address.startswith("198.18.") and b.address.startswith("198.18.") and a.address != b.address
    (tmp_path / "hello.txt").write_text("hello from host A")
    a.popen([sys.executable, "-m", "http.server", "--bind", a.address, "--directory", str(tmp_path), "8080"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = b.run([sys.executable, "-c", FETCH, f"http://{a.address}:8080/hello.txt"], timeout=30)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "hello from host A"
    # Bound to A's 198.18 address only: A's own loopback does not reach it (separate stacks, real binds).
    inside = a.run([sys.executable, "-c", "import socket; socket.create_connection(('127.0.0.1', 8080), 1)"])
    assert inside.returncode != 0


def test_teardown_removes_namespaces_links_and_processes_after_a_failure():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    seen = {}
    with pytest.raises(ZeroDivisionError):
        with netns.hosts(2) as (a, b):
            seen["tag"] = a.name.rsplit("-", 1)[1]
            seen["proc"] = a.popen(["sleep", "300"])
            assert sorted(netns.leftovers(seen["tag"])) != []
            1 / 0
    assert netns.leftovers(seen["tag"]) == []
    assert seen["proc"].poll() is not None


def test_plain_tcp_stream_between_hosts(two_hosts):
    a, b = two_hosts
    start = time.monotonic()
    result = tcp_throughput(a, b, nbytes=512 << 20)
    assert result.bytes == 512 << 20 and 0 < result.seconds < time.monotonic() - start
    print(f"\nplain TCP {a.name} <- {b.name}: {result.bytes >> 20} MiB in {result.seconds:.3f} s = "
          f"{result.gbps:.2f} GB/s")
