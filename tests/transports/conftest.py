"""Fixtures that run a transport's pool side in another process (in-process for `inproc`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.kv_pool import KVCache
from engine.transports import sender
from engine.transports.host import PoolHost
from engine.transports.nixl import available as nixl_available
from tandem.pool import Destination, PoolDescriptor
from tandem.wire import parse
from tests.transports.peer import LAYOUT, NUM_PAGES

PEER = os.path.join(os.path.dirname(__file__), "peer.py")
TRANSPORTS = ["inproc", "shm", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="NIXL not installed (pip install --no-deps nixl-cu12)"))]


class RemotePool:
    """The pool side in a child process."""

    def __init__(self, transport: str):
        self.transport = transport
        self.proc = subprocess.Popen([sys.executable, PEER, "pool", transport], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.descriptor = parse(PoolDescriptor, self._read()["descriptor"])

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pool process exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def destination(self, page_ids: list[int], start: int = 0) -> Destination:
        lease = self.ask(cmd="lease")
        return Destination(self.transport, self.descriptor, page_ids, lease["slot"], lease["epoch"], start)

    def revoke(self, slot: int) -> bool:
        return self.ask(cmd="revoke", slot=slot)["fenced"]

    def poll(self) -> dict:
        return self.ask(cmd="poll")

    def pages(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(self.ask(cmd="pages", ids=ids)["data"])  # [layers, 2, n, tpp, Hkv, hd]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=20)


class LocalPool:
    """The pool side in this process (inproc transport)."""

    transport = "inproc"

    def __init__(self):
        self.registry: dict = {}
        self.cache = KVCache(LAYOUT, NUM_PAGES)
        self.host = PoolHost(self.cache, ("inproc",), self.registry)
        self.descriptor = self.host.descriptor
        self.seen: dict = {}
        self.closed: set = set()

    def destination(self, page_ids: list[int], start: int = 0) -> Destination:
        slot, epoch = self.host.lease_slot()
        return Destination("inproc", self.descriptor, page_ids, slot, epoch, start)

    def revoke(self, slot: int) -> bool:
        return self.host.revoke(slot, lambda s: None)

    def poll(self) -> dict:
        notices = self.host.poll()
        for rid in notices.ready:
            self.seen[rid] = float(self.cache.data.abs().sum())
        self.closed |= notices.closed
        return {"done": self.seen, "closed": sorted(self.closed)}

    def pages(self, ids: list[int]) -> torch.Tensor:
        return self.cache.data[:, :, ids].clone()

    def close(self) -> None:
        self.host.close()


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture
def pool(transport):
    p = LocalPool() if transport == "inproc" else RemotePool(transport)
    yield p
    p.close()


@pytest.fixture
def kv_sender(transport, pool):
    s = sender(transport, LAYOUT, getattr(pool, "registry", None))
    yield s
    s.close()
