#!/usr/bin/env python3
"""What a LoRA adapter costs the engine: decode steps and a prompt pass with the base model, with every
row on an adapter, and with half the rows on each of two adapters, side by side.

    python scripts/bench_lora.py [--dtype float32] [--rank 16] [--batch 8] [--prompt-len 512] [--rounds 7]

The adapters are random (rank `--rank` on every q/k/v/o/gate/up/down projection), written in PEFT's
format to a temporary folder and loaded as `tandem serve --lora-modules` loads them (engine/lora.py).
The three cases alternate round by round in one process, so the host's noise falls on each alike; a
round is `--steps` decode steps of `--batch` sequences, and one prompt pass of `--prompt-len` tokens.
Prints each case's median decode tokens/s and prompt pass time, and their ratios to the base model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from engine.checkpoint import resolve
from engine.load import load_engine
from tandem.sampling_params import SamplingParams

PARTS = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn", "gate": "mlp", "up": "mlp",
         "down": "mlp"}


def write_adapter(folder: str, rank: int, seed: int) -> None:
    """A random rank-`rank` LoRA of the default model on every projection, in PEFT's saved format."""
    cfg = resolve("smollm2-135m").config
    D, I, qd, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, \
        cfg.num_kv_heads * cfg.head_dim
    dims = {"q": (D, qd), "k": (D, kvd), "v": (D, kvd), "o": (qd, D), "gate": (D, I), "up": (D, I), "down": (I, D)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for part, (d_in, d_out) in dims.items():
            key = f"base_model.model.model.layers.{i}.{PARTS[part]}.{part}_proj"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.01
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [f"{p}_proj" for p in dims]}, f)


def decode_rate(engine, loras: list[str], steps: int) -> float:
    """Output tokens/s of `steps` decode steps of one sequence per entry of `loras` (its adapter)."""
    seqs = [engine.new_sequence(f"d{i}", [1 + i, 200, 300, 400] * 16, SamplingParams(max_tokens=steps + 1,
                                                                                      ignore_eos=True, lora=a))
            for i, a in enumerate(loras)]
    for s in seqs:
        engine.admit(s)
    engine.prefill(seqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.decode_step(seqs)
    rate = steps * len(seqs) / (time.perf_counter() - t0)
    for s in seqs:
        engine.release(s)
    return rate


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
        for seed, folder in enumerate(folders.values()):
            write_adapter(folder, args.rank, seed)
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
