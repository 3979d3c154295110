#!/usr/bin/env python3
"""KV handoff benchmark, shm and NIXL side by side in one run (default model's KV layout).

For a 512- and a 4096-token prompt it prints:
- handoff throughput: all 30 layers' K/V written by this process into pages of a pool owned by
  another process (the decode side), vs a single-process memcpy of the same bytes;
- TTFT of prefill with the handoff (K/V written layer by layer during the pass) vs prefill alone
  (K/V discarded), both in this process with the pool in the other.

    python scripts/bench_handoff.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from engine.kv_pool import KVCache
from engine.transports import endpoint, sender
from engine.transports.nixl import available as nixl_available
from tandem.kv_layout import KVLayout

LENGTHS = (512, 4096)


def layout() -> KVLayout:
    return KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", tokens_per_page=16)


def pool_process(transport: str, pages: int) -> None:
    """The decode side: owns a pool, prints its descriptor, answers 'poll' until 'exit'."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    cache = KVCache(layout(), pages, shared=transport == "shm")
    cache.data.fill_(0)  # fault every page in, as a long-running decode worker's pool would be
    ep = endpoint(transport, cache)
    proto.write(json.dumps(ep.descriptor()) + "\n")
    proto.flush()
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        proto.write(json.dumps(sorted(ep.poll())) + "\n")
        proto.flush()
    ep.close()
    cache.close()


def layer_kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a prefill pass of n tokens produces: per layer K and V, [n, kv_heads, head_dim] each."""
    lay = layout()
    return [(torch.randn(n, lay.num_kv_heads, lay.head_dim), torch.randn(n, lay.num_kv_heads, lay.head_dim))
            for _ in range(lay.num_layers)]


def throughput(s, pool: dict, kv: list, repeats: int) -> float:
    """Best GB/s writing these K/V of all layers into the remote pool's pages."""
    lay = layout()
    n = kv[0][0].shape[0]
    pages = list(range(lay.pages_for(n)))
    best = float("inf")
    for r in range(repeats + 1):  # the first round warms the connection and the mapping
        w = s.writer(pool, f"t{n}-{r}", pages)
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
        t = time.perf_counter()
        for (k, v), (dk, dv) in zip(kv, dst):
            dk.copy_(k)
            dv.copy_(v)
        if r:
            best = min(best, time.perf_counter() - t)
    return kv[0][0].shape[0] * layout().bytes_per_token / best / 1e9


def ttft(worker, prompt: list[int], pool: dict | None, repeats: int) -> float:
    """Best seconds for one prefill request (with the handoff when `pool` is given)."""
    from tandem.sampling import SamplingParams
    from tandem.wire import Destination, PrefillRequest

    lay = layout()
    best = float("inf")
    for r in range(repeats):
        dest = Destination(pool, list(range(lay.pages_for(len(prompt)))), "bench") if pool else None
        req = PrefillRequest(f"p{r}", SamplingParams(max_tokens=1).to_dict(), dest)
        t = time.perf_counter()
        out = worker.prefill_all([(prompt, req)])[0]
        if isinstance(out, Exception):
            raise out
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pages = layout().pages_for(max(LENGTHS))
    if args.pool:
        return pool_process(args.pool, pages)
    from engine.engine import Engine
    from engine.load import load_engine
    from engine.workers.prefill import PrefillWorker

    base = load_engine("smollm2-135m", kv_bytes=None)
    words = ("The orchard behind the old mill grows apples, pears and plums in long rows. " * 400).strip()
    prompts = {n: base.tokenizer.encode(words)[:n] for n in LENGTHS}
    transports = ["shm"] + (["nixl"] if nixl_available() else [])
    print(f"threads={args.threads}  KV: {layout().bytes_per_token} bytes/token (30 layers, 3 KV heads, 64 dims, fp32)")
    print(f"{'transport':>9} {'tokens':>6} {'MB':>7} {'handoff GB/s':>13} {'memcpy GB/s':>12} {'ratio':>6} "
          f"{'TTFT alone s':>13} {'TTFT+handoff s':>15} {'added':>7}")
    for name in transports:
        proc = subprocess.Popen([sys.executable, __file__, "--pool", name, "--threads", "1"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            pool = json.loads(proc.stdout.readline())
            s = sender(name, layout())
            worker = PrefillWorker(Engine(base.model, base.tokenizer, None))
            worker.senders[name] = s
            for n in LENGTHS:
                kv = layer_kv(n)
                gbs = throughput(s, pool, kv, args.repeats)
                mem = memcpy_gbs(kv, args.repeats)
                alone = ttft(worker, prompts[n], None, args.repeats)
                with_h = ttft(worker, prompts[n], pool, args.repeats)
                print(f"{name:>9} {n:>6} {n * layout().bytes_per_token / 1e6:>7.1f} {gbs:>13.2f} {mem:>12.2f} "
                      f"{gbs / mem:>5.2f}x {alone:>13.3f} {with_h:>15.3f} {(with_h / alone - 1):>+7.1%}")
            s.close()
        finally:
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
