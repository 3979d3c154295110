#!/usr/bin/env python3
"""What a LoRA adapter costs the engine: decode steps and a prompt pass with the base model, with every
row on an adapter, and with half the rows on each of two adapters, side by side.

    python scripts/bench_lora.py [--dtype float32] [--rank 16] [--batch 8] [--prompt-len 512] [--rounds 7]

The adapters are random (rank `--rank` on every q/k/v/o/gate/up/down projection), written in PEFT's
format to a temporary folder as the device check writes its own (scripts/gpu_check/lora_check.py) and
loaded as `tandem serve --lora-modules` loads them (engine/lora.py).
The three cases alternate round by round in one process, so the host's noise falls on each alike; a
round is `--steps` decode steps of `--batch` sequences, and one prompt pass of `--prompt-len` tokens.
Prints each case's median decode tokens/s and prompt pass time, and their ratios to the base model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.checkpoint import resolve  # noqa: E402
from engine.load import load_engine  # noqa: E402
from scripts.gpu_check.lora_check import decode_rate, write_adapter  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402


def prompt_pass(engine, lora: str, n: int) -> float:
    """Seconds of one prompt pass of `n` tokens with adapter `lora` ("" for none)."""
    seq = engine.new_sequence("p", [(7 * i) % 5000 + 10 for i in range(n)], SamplingParams(max_tokens=1, lora=lora))
    engine.admit(seq)
    t0 = time.perf_counter()
    engine.prefill([seq])
    took = time.perf_counter() - t0
    engine.release(seq)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {name: os.path.join(tmp, name) for name in ("a", "b")}
        cfg = resolve("smollm2-135m").config
        for seed, folder in enumerate(folders.values()):
            write_adapter(folder, cfg, seed, args.rank)
        engine = load_engine("smollm2-135m", dtype=args.dtype, kv_bytes=256 << 20, lora_modules=folders)
    half = args.batch // 2
    cases = {"base": [""] * args.batch, "adapter": ["a"] * args.batch,
             "two adapters": ["a"] * half + ["b"] * (args.batch - half)}
    rates: dict[str, list[float]] = {c: [] for c in cases}
    passes: dict[str, list[float]] = {c: [] for c in cases}
    for r in range(args.rounds + 1):  # the first round warms up and is not counted
        for case, loras in cases.items():
            rate, took = decode_rate(engine, loras, args.steps), prompt_pass(engine, loras[-1], args.prompt_len)
            if r:
                rates[case].append(rate)
                passes[case].append(took)
    base_rate, base_pass = statistics.median(rates["base"]), statistics.median(passes["base"])
    print(f"{args.dtype}, rank {args.rank}, {args.threads} threads; decode batch {args.batch}, "
          f"prompt {args.prompt_len} tokens; median of {args.rounds} rounds")
    print("| case | decode tok/s | vs base | prompt pass ms | vs base |")
    print("|---|---|---|---|---|")
    for case in cases:
        rate, took = statistics.median(rates[case]), statistics.median(passes[case])
        print(f"| {case} | {rate:.1f} | {rate / base_rate:.2f} | {took * 1e3:.0f} | {took / base_pass:.2f} |")


if __name__ == "__main__":
    main()
