"""Fixtures that run a transport's pool side in another process (in-process for `inproc`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.kv_pool import KVCache
from engine.transports import endpoint, sender
from engine.transports.nixl import available as nixl_available
from tests.transports.peer import LAYOUT, NUM_PAGES

PEER = os.path.join(os.path.dirname(__file__), "peer.py")
TRANSPORTS = ["inproc", "shm", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="NIXL not installed (pip install --no-deps nixl-cu12)"))]


class RemotePool:
    """The pool side in a child process."""

    def __init__(self, transport: str):
        self.proc = subprocess.Popen([sys.executable, PEER, "pool", transport], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.descriptor = self._read()["descriptor"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pool process exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def poll(self) -> dict:
        return self.ask(cmd="poll")["done"]

    def pages(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(self.ask(cmd="pages", ids=ids)["data"])  # [layers, 2, n, tpp, Hkv, hd]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=20)


class LocalPool:
    """The pool side in this process (inproc transport)."""

    def __init__(self):
        self.registry: dict = {}
        self.cache = KVCache(LAYOUT, NUM_PAGES)
        self.ep = endpoint("inproc", self.cache, self.registry)
        self.descriptor = self.ep.descriptor()
        self.seen: dict = {}

    def poll(self) -> dict:
        for rid in self.ep.poll():
            self.seen[rid] = float(self.cache.data.abs().sum())
        return self.seen

    def pages(self, ids: list[int]) -> torch.Tensor:
        return self.cache.data[:, :, ids].clone()

    def close(self) -> None:
        self.ep.close()


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
