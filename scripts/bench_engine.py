#!/usr/bin/env python3
"""Engine benchmark: this engine vs Hugging Face transformers and llama.cpp, in one run, same threads.

For each dtype: decode tokens/s at several batch sizes (transformers: padded batch through `generate`,
same prompts, fp32), prefill tokens/s for one long prompt, the wall time of a short prefill pass,
and batch-1 decode against the memory-bandwidth floor (weight bytes / read bandwidth, measured right before
and right after that decode measurement: this machine's bandwidth drifts by tens of percent within minutes).
llama.cpp (scripts/bench_llamacpp.py) runs the same weights at the same precision: batch-1 decode and
prompt processing. This machine is shared and noisy, so only ratios within one run mean anything; the
load average is recorded with the numbers.

    python scripts/bench_engine.py [--dtypes float32,bfloat16] [--batches 1,32] [--out docs/benchmarks/engine]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import time

import torch

from bench_llamacpp import LlamaCpp, load_llama_cpp, same_gguf
from engine.cpu_kernels.build import cpu_flags, isa, load as load_cpu_kernels
from engine.cpu_kernels.gemv import onednn_takes
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


def peak_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose library product measures `dtype`'s arithmetic peak: itself, but fp32 for bf16 where
    PyTorch has no fast bf16 product (an AVX2 CPU: its bf16 product runs at ~1 GFLOP/s, and any engine's
    bf16 there is fp32 arithmetic on widened values)."""
    return torch.float32 if dtype == torch.bfloat16 and not onednn_takes(dtype) else dtype


def product_peak_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """The best rate of PyTorch's own n x n matrix product in `dtype` on this machine's threads: as near
    the CPU's arithmetic peak as a library gets (the ceiling below is computed from it)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def pass_gflop(model, rows: int, contexts: list[int], head_rows: int) -> float:
    """Arithmetic of a pass: `rows` rows through every layer's products, each row's attention over its
    context (`contexts`, one per row: q.k and p.v), and `head_rows` rows of the output head."""
    c = model.cfg
    per_row = sum(d.out_features * d.in_features for L in model.layers for d in (L.qkv, L.o, L.gate_up, L.down))
    attention = 4 * c.head_dim * c.num_heads * c.num_layers * sum(contexts)
    return (2 * rows * per_row + attention + 2 * head_rows * c.vocab_size * c.hidden_size) / 1e9


def bench_dtype(dtype: str, args, hf, gguf_src: str, llama_cpp) -> dict:
    """Every measure of one dtype: tandem and llama.cpp in that dtype and transformers (fp32), each measure
    taken by all three one after the other (the load of a shared machine drifts within minutes)."""
    engine = load_engine("smollm2-135m", dtype=dtype, kv_bytes=512 << 20)
    lc = None if llama_cpp is None else LlamaCpp(llama_cpp, same_gguf(gguf_src, dtype), args.threads,
                                                 n_ctx=max(args.prefill_len, args.prompt_len) + args.new_tokens + 8)
    pad = engine.tokenizer.eos_token_id
    r: dict = {"weight_bytes": engine.model.weight_bytes, "decode": {}, "gflop": {},
               "peak_gflops": product_peak_gflops(peak_dtype(getattr(torch, dtype))),
                    "peak_dtype": str(peak_dtype(getattr(torch, dtype))).removeprefix("torch.")}
    batches = [int(x) for x in args.batches.split(",")]
    steps = range(args.prompt_len, args.prompt_len + args.new_tokens - 1)  # the measured steps' contexts
    for b in batches:
        r["gflop"][f"decode {b}"] = sum(pass_gflop(engine.model, b, [n + 1] * b, b) for n in steps) / len(steps)
    r["gflop"]["prefill"] = pass_gflop(engine.model, args.prefill_len, list(range(1, args.prefill_len + 1)), 1)
    for b in batches:
        batch = prompts(engine.tokenizer, b, args.prompt_len)
        bw_before = read_bandwidth_gbs() if b == min(batches) else None
        r["decode"][b] = {"tandem": best_of(lambda: ours_decode(engine, batch, args.new_tokens), args.repeats),
                          "transformers": best_of(lambda: hf_decode(hf, batch, args.new_tokens, pad), args.repeats)}
        if bw_before is not None:  # the best of the two: the floor is what the machine could do then
            r["bandwidth_gbs"] = max(bw_before, read_bandwidth_gbs())
        if lc is not None and b == 1:  # llama-cpp-python's eval runs one sequence
            r["decode"][b]["llama.cpp"] = best_of(lambda: lc.decode(batch[0], args.new_tokens), args.repeats)
    for key, n in (("prefill", args.prefill_len), ("short_prefill", args.short_len)):
        p = prompts(engine.tokenizer, 1, n)[0]
        r[key] = {"tokens": len(p), "tandem": best_of(lambda: ours_prefill(engine, p), args.repeats),
                  "transformers": best_of(lambda: hf_prefill(hf, p), args.repeats)}
        if lc is not None:
            r[key]["llama.cpp"] = best_of(lambda: lc.prefill(p), args.repeats)
    del lc
    del engine
    gc.collect()
    return r


def cpu_name() -> str:
    """The CPU's model name and the flags that decide which kernels run (the ratios to transformers
    depend on them: PyTorch's fp32 GEMM is at the CPU's peak on Intel, on a generic path elsewhere)."""
    flags = cpu_flags()
    model = next((ln.partition(":")[2].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    shown = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    return f"{model}, {os.cpu_count()} logical, {shown}"


def report(res: dict) -> str:
    """The run as markdown: one table per dtype, ratios to tandem's numbers, and the floor."""
    lines = [f"threads={res['threads']}, model smollm2-135m, prompt {res['prompt_len']} tokens, "
             f"{res['new_tokens']} new tokens; load average {res['load_start']} at start, {res['load_end']} at end; "
             f"CPU kernels: {res['kernel']}; CPU: {res.get('cpu', 'not recorded')}", ""]
    for dtype, r in res["dtypes"].items():
        bw = r["bandwidth_gbs"]
        lines += [f"### {dtype}", "", "| measure | tandem | transformers (fp32) | tandem / transformers | llama.cpp | "
                  "tandem / llama.cpp |", "|---|---|---|---|---|---|"]

        def row(name, d, unit="tok/s"):
            lc = d.get("llama.cpp")
            lc_cols = f"{lc:.1f} | {d['tandem'] / lc:.2f}x" if lc else "- | -"
            lines.append(f"| {name} | {d['tandem']:.1f} {unit} | {d['transformers']:.1f} | "
                         f"{d['tandem'] / d['transformers']:.2f}x | {lc_cols} |")

        for b, d in r["decode"].items():
            row(f"decode, batch {b} (aggregate)", d)
        row(f"prefill, {r['prefill']['tokens']} tokens", r["prefill"])
        row(f"prefill, {r['short_prefill']['tokens']} tokens", r["short_prefill"])
        b1 = min(r["decode"])
        floor_ms = r["weight_bytes"] / (bw * 1e9) * 1e3
        step_ms = 1e3 * b1 / r["decode"][b1]["tandem"]
        short_ms = 1e3 * r["short_prefill"]["tokens"] / r["short_prefill"]["tandem"]
        lines += ["", f"- batch-{b1} decode step {step_ms:.1f} ms; floor {floor_ms:.1f} ms "
                      f"({r['weight_bytes'] / 1e6:.0f} MB of weights at {bw:.1f} GB/s, the read bandwidth measured "
                      f"around it): {floor_ms / step_ms:.0%} of floor speed",
                  f"- a {r['short_prefill']['tokens']}-token prefill pass: {short_ms:.1f} ms"]
        if "peak_gflops" in r:
            lines.append(ceiling(r))
        lines.append("")
    return "\n".join(lines)


def ceiling(r: dict) -> str:
    """The fastest any engine of this dtype could be here: each measured pass's arithmetic at the peak
    product rate, as a ratio to transformers' time for the same pass in this run."""
    peak = r["peak_gflops"]
    parts = []
    for name, d, rows in [(f"batch-{b} decode step", r["decode"][b], b) for b in r["decode"] if b > 1] + \
                         [(f"{r['prefill']['tokens']}-token prefill", r["prefill"], r["prefill"]["tokens"])]:
        gflop = r["gflop"]["prefill" if "prefill" in name else f"decode {rows}"]
        least_ms, theirs_ms = gflop / peak * 1e3, rows / d["transformers"] * 1e3
        parts.append(f"{name} {gflop:.1f} GFLOP, >= {least_ms:.0f} ms (transformers {theirs_ms:.0f} ms: at most "
                     f"{theirs_ms / least_ms:.2f}x)")
    of = r.get("peak_dtype", "")
    return f"- ceiling at the peak product rate ({peak:.0f} GFLOP/s, PyTorch's {of} 2048 x 2048): " + "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--short-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--out", default=None, help="folder for report.md and report.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    package, filename, _ = KNOWN_MODELS["smollm2-135m"]
    folder = list(importlib.util.find_spec(package).submodule_search_locations)[0]
    llama_cpp = None if args.no_llama_cpp else load_llama_cpp()
    res = {"threads": args.threads, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "load_start": [round(x, 1) for x in os.getloadavg()], "dtypes": {},
           "kernel": f"Tandem's (engine/cpu_kernels, {isa()})" if load_cpu_kernels() else "PyTorch's",
           "cpu": cpu_name()}
    # transformers in fp32: its GGUF loader keeps the weights packed and computes in fp32, and says fp32
    # is its fastest CPU setting (asked for bf16, it casts around every matmul)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32).eval()
    for dtype in args.dtypes.split(","):
        res["dtypes"][dtype] = bench_dtype(dtype, args, hf, os.path.join(folder, filename), llama_cpp)
    res["load_end"] = [round(x, 1) for x in os.getloadavg()]
    text = report(res)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
