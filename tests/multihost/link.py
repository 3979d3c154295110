"""Plain TCP throughput between two test hosts: the yardstick for KV handoff over the same link.

    result = tcp_throughput(receiver_host, sender_host, nbytes=1 << 30)
    print(result.gbps)                         # GB/s (10^9 bytes per second) of one TCP stream

"Handoff GB/s vs a plain TCP stream of the same bytes over the same link": the receiver runs in one
namespace host, the sender in another; the time is the sender's, from its first byte to the
receiver's one-byte acknowledgement after the last byte arrived, so it covers full delivery.
The same file is the two processes' program: `python link.py recv ADDRESS` / `send ADDRESS PORT N`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

CHUNK = 4 << 20  # bytes per send/recv call


@dataclass(frozen=True)
class LinkResult:
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


def receive(address: str) -> None:
    """Listen on address (a free port), print {"port": p}, take one connection, read until the peer
    closes, then acknowledge with one byte and print {"received": n}."""
    with socket.create_server((address, 0)) as srv:
        print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(CHUNK)
            total = 0
            while True:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                total += n
            conn.sendall(b"k")
    print(json.dumps({"received": total}), flush=True)


def send(address: str, port: int, nbytes: int) -> None:
    """Send nbytes to address:port, half-close, wait for the one-byte ack; print {"bytes", "seconds"}."""
    payload = memoryview(os.urandom(min(CHUNK, nbytes)))
    with socket.create_connection((address, port), timeout=60) as conn:
        start = time.perf_counter()
        left = nbytes
        while left:
            part = payload[:min(left, len(payload))]
            conn.sendall(part)
            left -= len(part)
        conn.shutdown(socket.SHUT_WR)
        if conn.recv(1) != b"k":
            raise ConnectionError("the receiver closed without acknowledging the bytes")
        seconds = time.perf_counter() - start
    print(json.dumps({"bytes": nbytes, "seconds": seconds}), flush=True)


def tcp_throughput(receiver, sender, nbytes: int, timeout: float = 120.0) -> LinkResult:
    """One TCP stream of nbytes from `sender` to `receiver` (netns Hosts); the sender's timing."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    recv = receiver.popen([sys.executable, __file__, "recv", receiver.address], stdout=subprocess.PIPE, text=True)
    line = recv.stdout.readline()
    if not line:
        raise RuntimeError(f"TCP receiver in {receiver.name} exited with {recv.wait()} before listening")
    port = json.loads(line)["port"]
    out = sender.run([sys.executable, __file__, "send", receiver.address, str(port), str(nbytes)], timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"TCP sender failed: {out.stderr.strip()[-500:]}")
    got = json.loads(recv.stdout.readline())["received"]
    recv.wait(timeout=10)
    if got != nbytes:
        raise RuntimeError(f"receiver got {got} bytes, sender sent {nbytes}")
    res = json.loads(out.stdout)
    return LinkResult(res["bytes"], res["seconds"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["recv"] and len(sys.argv) == 3:
        receive(sys.argv[2])
    elif sys.argv[1:2] == ["send"] and len(sys.argv) == 5:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit("usage: link.py recv ADDRESS | link.py send ADDRESS PORT NBYTES")
