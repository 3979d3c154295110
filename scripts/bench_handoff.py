#!/usr/bin/env python3
"""KV handoff benchmark, shm and NIXL side by side in one run (default model's KV layout); with
`--device cuda`, cuda_ipc and NIXL with GPU memory (pools, K/V and engine on the GPU; not yet run on one).

For a 512- and a 4096-token prompt it prints:
- handoff throughput: all 30 layers' K/V written by this process into pages of a pool owned by
  another process (the decode side), vs a single-process memcpy of the same bytes;
- TTFT of prefill with the handoff (K/V written layer by layer during the pass) vs prefill alone
  (K/V discarded), both in this process with the pool in the other.

    python scripts/bench_handoff.py [--threads 2] [--repeats 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import torch

from engine.kv_pool import KVCache
from engine.transports import sender
from engine.transports.host import PoolHost
from engine.transports.nixl import available as nixl_available
from tandem.kv_layout import KVLayout
from tandem.pool import Destination, PoolDescriptor
from tandem.wire import parse

LENGTHS = (512, 4096)


def layout() -> KVLayout:
    return KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", tokens_per_page=16)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def pool_process(transport: str, pages: int, device: str) -> None:
    """The decode side: owns a pool, prints its descriptor, then leases a fence slot per 'lease' line."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    cache = KVCache(layout(), pages, device=device, shared=transport == "shm")
    cache.data.fill_(0)  # fault every page in, as a long-running decode worker's pool would be
    host = PoolHost(cache, (transport,))
    proto.write(json.dumps(asdict(host.descriptor)) + "\n")
    proto.flush()
    done = threading.Event()

    def progress():  # as a decode worker does while writes are in flight (UCX over TCP needs both sides)
        while not done.wait(0.001):
            host.poll()

    poller = threading.Thread(target=progress, daemon=True)
    poller.start()
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        slot, epoch = host.lease_slot()  # one slot per writer; the pool has a slot per page
        proto.write(json.dumps([slot, epoch]) + "\n")
        proto.flush()
    done.set()
    poller.join()
    host.close()
    cache.close()


class Pool:
    """The pool process, seen from the writer's side."""

    def __init__(self, transport: str, wrap: list[str] = (), device: str = "cpu"):
        """`wrap`: a command prefix for the pool process (e.g. another network namespace, and its UCX env)."""
        self.transport = transport
        self.proc = subprocess.Popen([*wrap, sys.executable, __file__, "--pool", transport, "--threads", "1",
                                      "--device", device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.descriptor = parse(PoolDescriptor, json.loads(self.proc.stdout.readline()))

    def destination(self, n_tokens: int) -> Destination:
        self.proc.stdin.write("lease\n")
        self.proc.stdin.flush()
        slot, epoch = json.loads(self.proc.stdout.readline())
        return Destination(self.transport, self.descriptor, list(range(layout().pages_for(n_tokens))), slot, epoch)

    def close(self) -> None:
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=30)


def layer_kv(n: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a prefill pass of n tokens produces: per layer K and V, [n, kv_heads, head_dim] each."""
    lay = layout()
    return [(torch.randn(n, lay.num_kv_heads, lay.head_dim, device=device),
             torch.randn(n, lay.num_kv_heads, lay.head_dim, device=device)) for _ in range(lay.num_layers)]


def throughput(s, pool: Pool, kv: list, repeats: int) -> float:
    """Best GB/s writing these K/V of all layers into the remote pool's pages."""
    lay = layout()
    n = kv[0][0].shape[0]
    best = float("inf")
    for r in range(repeats + 1):  # the first round warms the connection and the mapping
        w = s.writer(pool.destination(n), f"t{n}-{r}")
        t = time.perf_counter()
        for layer, (k, v) in enumerate(kv):
            w.write_layer(layer, k, v)
        w.finish()
        if r:
            best = min(best, time.perf_counter() - t)
    return n * lay.bytes_per_token / best / 1e9


def memcpy_gbs(kv: list, repeats: int) -> float:
    """The same bytes copied within one process: each layer's K and V into a preallocated buffer."""
    dst = [(torch.empty_like(k), torch.empty_like(v)) for k, v in kv]
    best = float("inf")
    for r in range(repeats + 1):
        sync(kv[0][0].device.type)
        t = time.perf_counter()
        for (k, v), (dk, dv) in zip(kv, dst):
            dk.copy_(k)
            dv.copy_(v)
        sync(kv[0][0].device.type)
        if r:
            best = min(best, time.perf_counter() - t)
    return kv[0][0].shape[0] * layout().bytes_per_token / best / 1e9


def ttft(engine, s, prompt: list[int], pool: Pool | None, repeats: int) -> float:
    """Best seconds for one prefill pass (with the handoff when `pool` is given)."""
    from engine.transports.base import DiscardWriter
    from tandem.sampling_params import SamplingParams

    best = float("inf")
    for r in range(repeats):
        seq = engine.new_sequence(f"p{r}", prompt, SamplingParams(max_tokens=1))
        writer = s.writer(pool.destination(len(prompt)), f"p{r}") if pool else DiscardWriter()
        t = time.perf_counter()
        engine.prefill([seq], [writer])
        writer.finish()
        sync(engine.device.type)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool", help=argparse.SUPPRESS)
    ap.add_argument("--transports", default=None, help="comma-separated (default: shm, and nixl if installed)")
    ap.add_argument("--pool-wrap", default="", help="command prefix for the pool process (scripts/bench_multihost.py)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where pools, K/V and the engine live (cuda: default transports cuda_ipc and nixl)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pages = layout().pages_for(max(LENGTHS))
    if args.pool:
        return pool_process(args.pool, pages, args.device)
    from engine.load import load_engine

    base = load_engine("smollm2-135m", device=args.device, kv_bytes=None)
    words = ("The orchard behind the old mill grows apples, pears and plums in long rows. " * 400).strip()
    prompts = {n: base.tokenizer.encode(words)[:n] for n in LENGTHS}
    local = "cuda_ipc" if args.device == "cuda" else "shm"
    transports = args.transports.split(",") if args.transports else [local] + (["nixl"] if nixl_available() else [])
    print(f"threads={args.threads}  KV: {layout().bytes_per_token} bytes/token (30 layers, 3 KV heads, 64 dims, fp32)")
    print(f"{'transport':>9} {'tokens':>6} {'MB':>7} {'handoff GB/s':>13} {'memcpy GB/s':>12} {'ratio':>6} "
          f"{'TTFT alone s':>13} {'TTFT+handoff s':>15} {'added':>7}")
    for name in transports:
        pool = Pool(name, shlex.split(args.pool_wrap), args.device)
        try:
            s = sender(name, layout(), device=args.device)
            for n in LENGTHS:
                kv = layer_kv(n, args.device)
                gbs = throughput(s, pool, kv, args.repeats)
                mem = memcpy_gbs(kv, args.repeats)
                alone = ttft(base, s, prompts[n], None, args.repeats)
                with_h = ttft(base, s, prompts[n], pool, args.repeats)
                print(f"{name:>9} {n:>6} {n * layout().bytes_per_token / 1e6:>7.1f} {gbs:>13.2f} {mem:>12.2f} "
                      f"{gbs / mem:>5.2f}x {alone:>13.3f} {with_h:>15.3f} {(with_h / alone - 1):>+7.1%}")
            s.close()
        finally:
            pool.close()

if __name__ == "__main__":
    main()
