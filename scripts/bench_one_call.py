#!/usr/bin/env python3
"""Prompt passes and a decode step, every layer in one call against the Python layer loop, side by side.

    python scripts/bench_one_call.py [--dtype float32] [--prompt-lens 16,128] [--batch 12] [--passes 15]
                                     [--one-call-rows N]

`--one-call-rows` lifts the engine's limit on one-call passes (engine/cpu_kernels/layers.py:
ONE_CALL_ROWS) for this run, to see where the limit should be. A prompt past the limit takes the
"one call" path as rounds of one call each where the dtype runs long passes in rounds (fp32:
layers.py IN_ROUNDS; engine/passes.py), the layer loop otherwise.

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
from engine.cpu_kernels import layers as cpu_layers
from engine.load import load_engine
from tandem.sampling_params import SamplingParams

TEXT = ("the river carried silt from the mountains to the delta where farmers planted rice and traders met at "
        "the market every few days ") * 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-lens", default="16", help="comma-separated prompt lengths, one pass each")
    ap.add_argument("--batch", type=int, default=12, help="sequences in the decode step")
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one-call-rows", type=int, default=None, help="the one-call limit for this run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.one_call_rows is not None:
        cpu_layers.ONE_CALL_ROWS[getattr(torch, args.dtype)] = args.one_call_rows
    engine = load_engine("smollm2-135m", dtype=args.dtype, kv_bytes=256 << 20)
    one_call = engine.model._one_call
    if one_call is None:
        raise SystemExit("the one-call step does not apply here (needs AVX-512 or AVX2 and the built kernels)")
    text_ids = engine.tokenizer.encode(TEXT)
    ids = text_ids[:16]
    print(f"{args.dtype}: one call takes passes of up to {engine.model.one_call_rows} rows; decode batch {args.batch}")

    def prompt_pass(n: int):
        prompt = (text_ids * (n // len(text_ids) + 1))[:n]  # n tokens: the text repeated as far as needed
        return lambda: len(prompt) / ours_prefill(engine, prompt)  # tokens / (tokens per second)

    params = SamplingParams(max_tokens=2 * args.passes + 2, ignore_eos=True)  # room for every step of both paths
    seqs = [engine.new_sequence(f"d{i}", ids[:8] + [i + 10], params) for i in range(args.batch)]
    for s in seqs:
        engine.admit(s)
        engine.prefill([s])

    def decode_step() -> float:
        t = time.perf_counter()
        engine.decode_step(seqs)
        return time.perf_counter() - t

    runs = [(f"{n}-token prompt pass", prompt_pass(n)) for n in map(int, args.prompt_lens.split(","))]
    for name, run in runs + [("decode step", decode_step)]:
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
