#!/usr/bin/env python3
"""What a busy neighbour core costs our engine: decode steps and a prefill pass on one core, alone and
while another process prefills on the next core (as a 1P1D or 2x1 layout's other worker does).

`tandem profile` times each pass on an otherwise idle machine and keeps the best of its repeats; a
served worker shares the memory bus and the last-level cache with its neighbours and sees typical
times. This prints both statistics, alone, beside a neighbour, and alone again (the machine's drift):

    python scripts/bench_neighbour.py [--model engines/smollm2-135m] [--cores 1,0] [--context 300]

Each decode batch is fresh: `batch` prompts of `context` tokens prefilled, then `--steps` steps timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from engine.load import load_engine
from planner import timing

HERE = os.path.dirname(os.path.abspath(__file__))
BATCHES = (1, 4, 16)
PROMPT = 256  # the prefill pass timed


def _engine(model: str, core: int):
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    role = os.path.join(model, "prefill")
    return load_engine(role if os.path.isdir(role) else model, kv_bytes=512 << 20)


def neighbour(model: str, core: int) -> None:
    """Prefill 512-token prompts on `core` until killed."""
    engine, gen = _engine(model, core), torch.Generator().manual_seed(1)
    print("ready", flush=True)
    while True:
        timing.prefill_pass(engine, 512, 1, gen)


def _decode(engine, gen, batch: int, context: int, steps: int) -> list[float]:
    seqs = timing.decode_set(engine, batch, context, gen, 512, lambda *_: None)
    try:
        engine.decode_step(seqs)  # warm-up
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.decode_step(seqs)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        timing.release_all(engine, seqs)


def measure(engine, gen, args) -> dict:
    """{what: (best, median) seconds} for each decode batch and the prefill pass."""
    out = {}
    for b in BATCHES:
        t = _decode(engine, gen, b, args.context, args.steps)
        out[f"decode batch {b}"] = (min(t), statistics.median(t))
    t = [timing.time_prefill(engine, PROMPT, 1, 1, gen) for _ in range(3)]
    out[f"prefill {PROMPT}"] = (min(t), statistics.median(t))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(os.path.dirname(HERE), "engines", "smollm2-135m"))
    ap.add_argument("--cores", default="1,0", help="MEASURED,NEIGHBOUR: the core timed and the busy one")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens of each decoding sequence")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--neighbour", type=int, default=None, help=argparse.SUPPRESS)  # the child's own mode
    args = ap.parse_args()
    if args.neighbour is not None:
        neighbour(args.model, args.neighbour)
        return
    mine, other = (int(c) for c in args.cores.split(","))
    engine, gen = _engine(args.model, mine), torch.Generator().manual_seed(0)
    runs = {"alone": measure(engine, gen, args)}
    child = subprocess.Popen([sys.executable, __file__, "--model", args.model, "--neighbour", str(other)],
                             stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # "ready": its engine is loaded and prefilling
        runs["beside a neighbour"] = measure(engine, gen, args)
    finally:
        child.kill()
        child.wait()
    runs["alone again"] = measure(engine, gen, args)
    print(f"core {mine}, neighbour prefilling on core {other}; milliseconds, best / median")
    print(f"{'':18s}" + "".join(f"{name:>21s}" for name in runs))
    for what in runs["alone"]:
        print(f"{what:18s}" + "".join(f"{r[what][0] * 1e3:11.1f} / {r[what][1] * 1e3:7.1f}" for r in runs.values()))
    base = {w: (a[1] + b[1]) / 2 for (w, a), b in zip(runs["alone"].items(), runs["alone again"].values())}
    print("median beside a neighbour / median alone (mean of both alone runs): "
          + ", ".join(f"{w} x{runs['beside a neighbour'][w][1] / base[w]:.2f}" for w in base))


if __name__ == "__main__":
    main()
