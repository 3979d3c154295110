"""A transport peer in its own process, driven over stdin/stdout with JSON lines (test helper).

    python peer.py pool  TRANSPORT          -> prints {"descriptor": ...}; then answers commands:
                                               (TRANSPORT nixl-vram: nixl with the pool in GPU memory)
        {"cmd": "lease"}                       -> {"slot": s, "epoch": e}   (a fence slot armed for a writer)
        {"cmd": "revoke", "slot": s}           -> {"fenced": bool}           (True: no write of it can land now)
        {"cmd": "poll"}                        -> {"done": {id: checksum at arrival}, "closed": [[slot, epoch]...]}
        {"cmd": "pages", "ids": [...]}         -> {"data": nested list [layers][2][pages][...]}
        {"cmd": "exit"}
    python peer.py write TRANSPORT          -> reads {"destination":..., "request_id":..., "seed":..., "tokens":...,
                                               "crash_after": layer or -1} and writes; exits 0 when done
                                               (GPU transports write K/V that live on the GPU).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import torch

from engine.kv_pool import KVCache
from engine.transports import sender
from engine.transports.host import PoolHost
from tandem.kv_layout import KVLayout
from tandem.pool import Destination
from tandem.wire import parse

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", tokens_per_page=4)
NUM_PAGES = 24
GPU_TRANSPORTS = {"cuda_ipc": "cuda_ipc", "nixl-vram": "nixl"}  # test id -> transport; pool and K/V on the GPU


def transport_name(kind: str) -> str:
    return GPU_TRANSPORTS.get(kind, kind)


def device_of(kind: str) -> str:
    return "cuda" if kind in GPU_TRANSPORTS else "cpu"


def layer_data(seed: int, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V a writer with this seed sends for a layer: [tokens, kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    k = torch.randn(tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g)
    return k, -k


def say(obj) -> None:
    PROTO.write(json.dumps(obj) + "\n")
    PROTO.flush()


PROTO = sys.stdout


def run_pool(kind: str) -> None:
    cache = KVCache(LAYOUT, NUM_PAGES, device=device_of(kind), shared=kind == "shm")
    host = PoolHost(cache, (transport_name(kind),))
    say({"descriptor": asdict(host.descriptor)})
    seen: dict[str, float] = {}
    closed: set = set()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "lease":
            slot, epoch = host.lease_slot()
            say({"slot": slot, "epoch": epoch})
        elif cmd["cmd"] == "revoke":
            say({"fenced": host.revoke(cmd["slot"], lambda slot: None)})
        elif cmd["cmd"] == "poll":
            notices = host.poll()
            for rid in notices.ready:
                seen[rid] = float(cache.data.abs().sum().cpu())  # what was visible when the notice arrived
            closed |= notices.closed
            say({"done": seen, "closed": sorted(closed)})
        elif cmd["cmd"] == "pages":
            say({"data": cache.data[:, :, cmd["ids"]].cpu().tolist()})
        elif cmd["cmd"] == "exit":
            break
    host.close()
    cache.close()


def run_write(kind: str) -> None:
    job = json.loads(sys.stdin.readline())
    device = device_of(kind)
    s = sender(transport_name(kind), LAYOUT, device=device)
    w = s.writer(parse(Destination, job["destination"]), job["request_id"])
    for layer in range(LAYOUT.num_layers):
        if layer == job.get("crash_after", -1):
            os._exit(17)  # die mid-transfer, without cleanup, like a killed worker
        w.write_layer(layer, *(x.to(device) for x in layer_data(job["seed"], layer, job["tokens"])))
    w.finish()
    say({"state": w.state.value, "bytes": w.bytes_written})
    s.close()


if __name__ == "__main__":
    PROTO = os.fdopen(os.dup(1), "w")  # libraries may print to stdout; keep fd 1 for the protocol only
    os.dup2(2, 1)
    {"pool": run_pool, "write": run_write}[sys.argv[1]](sys.argv[2])
