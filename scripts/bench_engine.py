#!/usr/bin/env python3
"""Engine benchmark: this engine vs Hugging Face transformers, in one run, same machine and threads.

Prints decode tokens/s at several batch sizes (transformers: padded batch through `generate`, same
prompts), prefill tokens/s for one long prompt (transformers: one forward), and the memory-bandwidth
floor of a batch-1 decode step (weight bytes / measured read bandwidth). This machine is shared and
noisy, so only the ratios within one run mean anything.

    python scripts/bench_engine.py [--batches 1,8,32] [--new-tokens 32] [--prefill-len 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

from engine.checkpoint import KNOWN_MODELS
from engine.load import load_engine
from tandem.sampling_params import SamplingParams

PROMPT_WORDS = ("The history of the river valley begins with small farming villages that traded grain, "
                "pottery and stories along the water. ").split()


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n different prompts of exactly `length` tokens."""
    out = []
    for i in range(n):
        words = PROMPT_WORDS[i % len(PROMPT_WORDS):] + PROMPT_WORDS * (length // 4 + 4)
        out.append(tokenizer.encode(f"Story {i}: " + " ".join(words))[:length])
    return out


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best of several full reads of a buffer larger than any cache."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def ours_decode(engine, batch: list[list[int]], new_tokens: int) -> float:
    """Aggregate decode tokens/s over `new_tokens - 1` steps after a prefill of the batch."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    seqs = [engine.new_sequence(f"b{i}", p, params) for i, p in enumerate(batch)]
    for s in seqs:
        engine.admit(s)
    engine.prefill(seqs)
    t = time.perf_counter()
    for _ in range(new_tokens - 1):
        engine.decode_step(seqs)
    dt = time.perf_counter() - t
    for s in seqs:
        engine.release(s)
    return len(batch) * (new_tokens - 1) / dt


def hf_decode(model, batch: list[list[int]], new_tokens: int, pad: int) -> float:
    """transformers generate on a left-padded batch; decode time = generate(n) - generate(1)."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    kw = dict(do_sample=False, pad_token_id=pad, attention_mask=mask)
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t_prefill = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t_all = time.perf_counter() - t
    return len(batch) * (new_tokens - 1) / (t_all - t_prefill)


def ours_prefill(engine, prompt: list[int]) -> float:
    seq = engine.new_sequence("p", prompt, SamplingParams(max_tokens=1))
    engine.admit(seq)
    t = time.perf_counter()
    engine.prefill([seq])
    dt = time.perf_counter() - t
    engine.release(seq)
    return len(prompt) / dt


def hf_prefill(model, prompt: list[int]) -> float:
    with torch.inference_mode():
        t = time.perf_counter()
        model(torch.tensor([prompt]), logits_to_keep=1)
        return len(prompt) / (time.perf_counter() - t)


def best_of(fn, repeats: int) -> float:
    return max(fn() for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="also print the numbers as one JSON object")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    engine = load_engine("smollm2-135m", kv_bytes=512 << 20)
    package, filename, _ = KNOWN_MODELS["smollm2-135m"]
    folder = list(importlib.util.find_spec(package).submodule_search_locations)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32).eval()
    pad = engine.tokenizer.eos_token_id
    res = {"threads": args.threads, "decode": {}}
    print(f"threads={args.threads}  model=smollm2-135m fp32  prompt_len={args.prompt_len}  new_tokens={args.new_tokens}")
    print(f"{'batch':>5} {'tandem tok/s':>13} {'transformers tok/s':>19} {'ratio':>6}")
    for b in [int(x) for x in args.batches.split(",")]:
        batch = prompts(engine.tokenizer, b, args.prompt_len)
        ours = best_of(lambda: ours_decode(engine, batch, args.new_tokens), args.repeats)
        theirs = best_of(lambda: hf_decode(hf, batch, args.new_tokens, pad), args.repeats)
        res["decode"][b] = {"tandem": ours, "transformers": theirs}
        print(f"{b:>5} {ours:>13.1f} {theirs:>19.1f} {ours / theirs:>5.2f}x")
    long = prompts(engine.tokenizer, 1, args.prefill_len)[0]
    ours_p = best_of(lambda: ours_prefill(engine, long), args.repeats)
    theirs_p = best_of(lambda: hf_prefill(hf, long), args.repeats)
    res["prefill"] = {"tokens": len(long), "tandem": ours_p, "transformers": theirs_p}
    print(f"prefill {len(long)} tokens: tandem {ours_p:.0f} tok/s, transformers {theirs_p:.0f} tok/s, "
          f"ratio {ours_p / theirs_p:.2f}x")
    bw = read_bandwidth_gbs()
    floor_ms = engine.model.weight_bytes / (bw * 1e9) * 1e3
    b1 = min(res["decode"]) if res["decode"] else None
    step_ms = 1e3 / res["decode"][b1]["tandem"] * b1 if b1 else float("nan")
    res["bandwidth"] = {"read_gbs": bw, "weight_bytes": engine.model.weight_bytes, "floor_ms": floor_ms,
                        "step_ms": step_ms}
    print(f"read bandwidth {bw:.1f} GB/s; weights {engine.model.weight_bytes / 1e6:.0f} MB -> floor {floor_ms:.1f} ms/step; "
          f"tandem batch-{b1} step {step_ms:.1f} ms = {floor_ms / step_ms:.0%} of floor speed")
    for b in res["decode"]:
        if b != b1:
            agg = res["decode"][b]["tandem"] / res["decode"][b1]["tandem"]
            print(f"batch-{b} aggregate = {agg:.1f}x tandem batch-{b1}")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
