"""Fixtures that run a transport's pool side in another process (in-process for `inproc`).

GPU transports (`cuda_ipc`, and `nixl-vram`: NIXL with the pool registered as GPU memory) are marked
`gpu`: collected everywhere, run only where CUDA is (tests/conftest.py skips them elsewhere)."""

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
from tests.transports.peer import LAYOUT, NUM_PAGES, device_of, transport_name

PEER = os.path.join(os.path.dirname(__file__), "peer.py")
_NO_NIXL = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed (pip install --no-deps nixl-cu12)")
TRANSPORTS = ["inproc", "shm", pytest.param("nixl", marks=_NO_NIXL), pytest.param("cuda_ipc", marks=pytest.mark.gpu),
              pytest.param("nixl-vram", marks=[pytest.mark.gpu, _NO_NIXL])]


class RemotePool:
    """The pool side in a child process."""

    def __init__(self, kind: str):
        self.kind = kind
        self.transport = transport_name(kind)
        self.proc = subprocess.Popen([sys.executable, PEER, "pool", kind], stdin=subprocess.PIPE,
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
def kv_device(transport) -> str:
    """Where the writer's K/V live: on the GPU for GPU transports (device-to-device copies)."""
    return device_of(transport)


@pytest.fixture
def kv_sender(transport, pool, kv_device):
    s = sender(transport_name(transport), LAYOUT, getattr(pool, "registry", None), kv_device)
    yield s
    s.close()
