#!/usr/bin/env python3
"""A short prompt pass and a decode step, every layer in one call against the Python layer loop, side by side.

    python scripts/bench_one_call.py [--dtype float32] [--prompt-len 16] [--batch 12] [--passes 15]

Both paths run in one process, alternating pass by pass, so the host's noise falls on both alike
(engine/cpu_kernels/layers.py; the loop is what the engine runs when the model cannot take the one call).
Prints the median and best wall time of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_engine import ours_prefill  # scripts/ is on sys.path when this runs as a script
from engine.load import load_engine
from tandem.sampling_params import SamplingParams

TEXT = ("the river carried silt from the mountains to the delta where farmers planted rice and traders met at "
        "the market every few days ") * 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=12, help="sequences in the decode step")
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = load_engine("smollm2-135m", dtype=args.dtype, kv_bytes=256 << 20)
    one_call = engine.model._one_call
    if one_call is None:
        raise SystemExit("the one-call step does not apply here (needs AVX-512 and the built kernels)")
    ids = engine.tokenizer.encode(TEXT)[:args.prompt_len]
    rows = engine.model.one_call_rows
    print(f"{args.dtype}: one call takes passes of up to {rows} rows; prompt {len(ids)} tokens, decode batch {args.batch}")

    def prompt_pass() -> float:
        return len(ids) / ours_prefill(engine, ids)  # tokens / (tokens per second)

    params = SamplingParams(max_tokens=2 * args.passes + 2, ignore_eos=True)  # room for every step of both paths
    seqs = [engine.new_sequence(f"d{i}", ids[:8] + [i + 10], params) for i in range(args.batch)]
    for s in seqs:
        engine.admit(s)
        engine.prefill([s])

    def decode_step() -> float:
        t = time.perf_counter()
        engine.decode_step(seqs)
        return time.perf_counter() - t

    for name, run in (("prompt pass", prompt_pass), ("decode step", decode_step)):
        times: dict[str, list[float]] = {"one call": [], "layer loop": []}
        for _ in range(args.passes):
            for path in times:
                engine.model._one_call = one_call if path == "one call" else None
                times[path].append(run() * 1e3)
        engine.model._one_call = one_call
        print(" | ".join(f"{name}, {path}: median {statistics.median(v):.1f} ms, best {min(v):.1f}"
                         for path, v in times.items()))
    for s in seqs:
        engine.release(s)


if __name__ == "__main__":
    main()
