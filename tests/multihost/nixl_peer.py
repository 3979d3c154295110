"""The two sides of a NIXL KV handoff as separate programs, for runs in two namespace hosts (test helper).

    python nixl_peer.py pool   -> prints {"nixl": {agent, metadata, base, bytes}}; then reads commands:
        {"cmd": "wait", "request_id": R, "pages": [...], "seed": S, "tokens": T}
                               -> waits for R's `done` notice, prints {"ready": bool, "exact": bool}
        {"cmd": "exit"}
    python nixl_peer.py write  -> reads {"nixl": ..., "request_id", "pages", "seed", "tokens"}; writes every
                                  layer through NixlSender; prints {"bytes": n, "seconds": s}; keeps its
                                  agent progressing until the next line on stdin, then closes
    python nixl_peer.py source -> the pull handoff's prefill side: a pool exported as a prefill worker
                                  exports it (PoolHost: NIXL, fence table); reads commands:
        {"cmd": "hold", "pages": [...], "seed": S, "tokens": T}
                               -> fills the pages, arms a fence slot: {"source": PullSource fields}
        {"cmd": "closed"}      -> {"closed": [[slot, epoch], ...]} (readers' notices so far)
        {"cmd": "exit"}
    python nixl_peer.py read   -> reads {"source": ..., "pages": [...], "seed": S}; reads the source's K/V
                                  with NixlReader into pages of its own pool; prints {"bytes", "seconds",
                                  "exact"}

It drives the project's transport (engine/transports/nixl.py: NixlEndpoint, NixlSender) with the
model's real KV shape (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64), so its timing is the
handoff's GB/s across the link. UCX settings come from the environment the test gives each process.
The descriptor crosses as JSON on stdin/stdout, as it does on the real control channel.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict

import torch

from engine.kv_pool import KVCache
from engine.transports.nixl import NixlEndpoint, NixlSender
from tandem.kv_layout import KVLayout
from tandem.pool import Destination, NixlPool, PoolDescriptor, PullSource
from tandem.wire import parse

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", tokens_per_page=16)
NUM_PAGES = 512  # 4096 tokens: 184 MiB of K/V


def layer_data(seed: int, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V the writer sends for one layer: [tokens, kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    k = torch.randn(tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g)
    return k, -k


def landed_exactly(cache: KVCache, pages: list[int], seed: int, tokens: int) -> bool:
    for layer in range(LAYOUT.num_layers):
        k, v = layer_data(seed, layer, tokens)
        got = cache.data[layer, :, pages].reshape(2, -1, LAYOUT.num_kv_heads, LAYOUT.head_dim)[:, :tokens]
        if not (torch.equal(got[0], k) and torch.equal(got[1], v)):
            return False
    return True


def destination(nixl: dict, pages: list[int]) -> Destination:
    pool = PoolDescriptor(layout=LAYOUT, num_pages=NUM_PAGES, num_slots=1, host="remote", nixl=NixlPool(**nixl))
    return Destination(transport="nixl", pool=pool, page_ids=pages, slot=0, epoch=1)


def run_pool(out) -> None:
    cache = KVCache(LAYOUT, NUM_PAGES)
    ep = NixlEndpoint(cache)
    part = ep.part()
    say(out, {"nixl": {"agent": part.agent, "metadata": part.metadata, "base": part.base, "bytes": part.bytes}})
    ready: set[str] = set()
    lock, stop = threading.Lock(), threading.Event()

    def progress() -> None:
        # Over UCX's TCP transport a WRITE completes only while the *target* makes progress too
        # (RMA is emulated with active messages); polling notices is what drives it here.
        while not stop.is_set():
            got = ep.poll().ready
            with lock:
                ready.update(got)
            time.sleep(0.0005)

    poller = threading.Thread(target=progress, daemon=True)
    poller.start()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with lock:
                ok = cmd["request_id"] in ready
            if ok:
                break
            time.sleep(0.005)
        say(out, {"ready": ok, "exact": ok and landed_exactly(cache, cmd["pages"], cmd["seed"], cmd["tokens"])})
    stop.set()
    poller.join()
    ep.close()


def run_write(out) -> None:
    job = json.loads(sys.stdin.readline())
    s = NixlSender(LAYOUT)
    data = [layer_data(job["seed"], layer, job["tokens"]) for layer in range(LAYOUT.num_layers)]
    w = s.writer(destination(job["nixl"], job["pages"]), job["request_id"])
    start = time.perf_counter()
    for layer, (k, v) in enumerate(data):
        w.write_layer(layer, k, v)
    w.finish()
    seconds = time.perf_counter() - start
    say(out, {"bytes": w.bytes_written, "seconds": seconds})
    # `finish` only queued the `done` notice: over TCP it leaves only while this agent makes progress,
    # as a live prefill worker's would. Keep progressing until told to close (the pool has it by then).
    closing = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), closing.set()), daemon=True).start()
    while not closing.wait(0.001):
        s.agent.get_new_notifs()
    s.close()


def run_source(out) -> None:
    from engine.transports.base import copy_into_pages, page_runs
    from engine.transports.host import PoolHost

    cache = KVCache(LAYOUT, NUM_PAGES)
    host = PoolHost(cache, ("nixl",))
    closed: set = set()
    lock, stop = threading.Lock(), threading.Event()

    def progress() -> None:  # a prefill worker polls its pool while NIXL holds wait (holds.py): READs
        while not stop.is_set():  # over UCX's TCP complete only while the target progresses too
            got = host.poll().closed
            with lock:
                closed.update(got)
            time.sleep(0.0005)

    poller = threading.Thread(target=progress, daemon=True)
    poller.start()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "hold":
            for layer in range(LAYOUT.num_layers):
                k, v = layer_data(cmd["seed"], layer, cmd["tokens"])
                copy_into_pages(cache.data[layer, 0], page_runs(cmd["pages"]), k)
                copy_into_pages(cache.data[layer, 1], page_runs(cmd["pages"]), v)
            slot, epoch = host.lease_slot()
            say(out, {"source": asdict(PullSource("req-p", "hold", "nixl", host.descriptor, cmd["pages"],
                                                  cmd["tokens"], slot, epoch, 0))})
        elif cmd["cmd"] == "closed":
            with lock:
                say(out, {"closed": sorted(closed)})
        else:
            break
    stop.set()
    poller.join()
    host.close()


def run_read(out) -> None:
    from engine.transports.pull_nixl import NixlReader

    job = json.loads(sys.stdin.readline())
    source = parse(PullSource, job["source"])
    cache, r = KVCache(LAYOUT, NUM_PAGES), NixlReader(LAYOUT)
    start = time.perf_counter()
    n = r.read(source, cache, job["pages"])
    seconds = time.perf_counter() - start
    say(out, {"bytes": n, "seconds": seconds, "exact": landed_exactly(cache, job["pages"], job["seed"],
                                                                       source.tokens)})
    r.close()


def say(out, obj) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


if __name__ == "__main__":
    proto = os.fdopen(os.dup(1), "w")  # UCX/NIXL may print to stdout: keep fd 1 for the protocol only
    os.dup2(2, 1)
    {"pool": run_pool, "write": run_write, "source": run_source, "read": run_read}[sys.argv[1]](proto)
