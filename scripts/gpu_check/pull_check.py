"""The pull handoff's read sides on a device: a child process holds K/V in a pool exported the way a
prefill worker exports it (engine/transports/host.py: cuda_ipc for a pool on the GPU, NIXL with the
pool registered as GPU memory; shm and NIXL DRAM in a --dry-run on CPU), and this process reads them
with the project's readers (engine/transports/pull*.py) into a pool of its own, as a decode worker does.

Each transport reports: the bytes read exact (a pattern that a shifted, partial or stale read cannot
match), GB/s of one read of `pages` pages, and the fence: after the child revokes the hold's slot a
read fails LEASE_LOST and leaves the destination untouched. The child speaks JSON lines on its stdin
and stdout; nothing is pickled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

import torch

from engine.kv_pool import KVCache
from engine.transports.pull import reader
from tandem.kv_layout import KVLayout
from tandem.pool import PoolDescriptor, PullSource
from tandem.status import LeaseLost
from tandem.wire import parse

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=64, dtype="float32", tokens_per_page=16)


def _pattern(data: torch.Tensor, pages: list[int], seed: int) -> torch.Tensor:
    """What the held pages hold: [layers, 2, P, tpp, Hkv, hd], distinct per page, layer and seed."""
    shape = (data.shape[0], data.shape[1], len(pages), *data.shape[3:])
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(data.device)


class Holder:
    """The child process: a pool exported over one transport, with one hold at a time."""

    def __init__(self, transport: str, device: str, pages: int):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, "-m", "scripts.gpu_check.pull_check", transport, device,
                                      str(pages)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.descriptor = parse(PoolDescriptor, self.ask())

    def ask(self, **cmd) -> dict:
        if cmd:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the holder process exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask(cmd="exit")
            self.proc.wait(timeout=60)


def read_check(transport: str, device: torch.device, pages: int, repeat: int = 5) -> dict:
    """Hold `pages` pages in a child, read them here; exactness, GB/s, and the fence's refusal."""
    holder = Holder(transport, device.type, pages)
    r = reader(transport, LAYOUT)
    try:
        ids = list(range(pages))
        held = holder.ask(cmd="hold", pages=ids, seed=7)
        src = PullSource("check", "hold", transport, holder.descriptor, ids, pages * LAYOUT.tokens_per_page,
                         held["slot"], held["epoch"], 0)
        local = KVCache(LAYOUT, pages, device=str(device))
        dst = list(reversed(ids))  # another page order than the source's: each table must be followed
        r.read(src, local, dst)
        exact = bool(torch.equal(local.data[:, :, dst], _pattern(local.data, ids, 7)))
        t0 = time.perf_counter()
        for _ in range(repeat):
            n = r.read(src, local, dst)
        s = (time.perf_counter() - t0) / repeat
        holder.ask(cmd="revoke", slot=held["slot"])
        local.data.zero_()
        try:
            r.read(src, local, dst)
            fenced = False
        except LeaseLost:
            fenced = not bool(local.data.any())
        return {"pages": pages, "bytes": n, "gbps": round(n / s / 1e9, 2), "correct": exact and fenced,
                "exact": exact, "late_read_refused": fenced}
    finally:
        r.close()
        holder.close()


def _child(transport: str, device: str, pages: int) -> None:
    from engine.transports.host import PoolHost

    out = os.fdopen(os.dup(1), "w")  # libraries may print to stdout: keep fd 1's copy for the protocol
    os.dup2(2, 1)
    cache = KVCache(LAYOUT, pages, device=device, shared=transport == "shm")
    host = PoolHost(cache, (transport,))

    def say(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say(asdict(host.descriptor))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "hold":
            cache.data[:, :, cmd["pages"]] = _pattern(cache.data, cmd["pages"], cmd["seed"])
            if cache.data.is_cuda:
                torch.cuda.synchronize(cache.device)  # a prefill worker answers after its pass completed
            slot, epoch = host.lease_slot()
            say({"slot": slot, "epoch": epoch})
        elif cmd["cmd"] == "revoke":
            say({"fenced": host.revoke(cmd["slot"], lambda s: None)})
        elif cmd["cmd"] == "exit":
            say({"bye": True})
            break
    host.close()
    cache.close()


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
