#!/usr/bin/env python3
"""Where a decode step and a prefill pass spend their time: torch profiler, ops grouped by kind.

    python scripts/profile_engine.py [--dtype float32] [--threads 2] [--batch 1] [--prefill-len 16]

Prints, for a batch decode step and a prefill pass, the wall time per pass and a short table of
CPU time per op group (matmuls, attention, KV gather/write, norms+rope+elementwise, LM head is part
of matmuls, sampling and the rest), plus how many ops ran: the per-op dispatch cost shows as
the gap between the sum of op self times and the wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engine.cpu_kernels.build import load as load_cpu_kernels
from engine.load import load_engine
from tandem.sampling_params import SamplingParams

GROUPS = (  # (group, substrings of op names), first match wins
    # a few-row decode step's layers in one call: its products, attention and norms (its few ATen ops count apart)
    ("decode layers, one call", ("decode_layers",)),
    ("matmul", ("linear", "addmm", "mm", "matmul", "bmm", "gemv")),
    ("attention", ("scaled_dot_product", "flash_attention", "softmax", "decode_step_attention", "decode_attention")),
    ("kv gather/write", ("index_select", "index_copy", "index_put")),
    ("sampling", ("argmax", "topk", "multinomial", "log_softmax")),
    ("elementwise", ("mul", "add", "silu", "rsqrt", "pow", "mean", "cat", "neg", "to", "copy", "sub", "rms_norm")),
)
KERNELS = ("gemv", "decode_step_attention", "decode_attention", "rms_norm", "decode_layers")  # engine/cpu_kernels, shown as tandem::


@contextlib.contextmanager
def cpu_kernels_shown():
    """Tandem's CPU kernels are plain extension functions the profiler does not see: while profiling,
    each is wrapped in a labelled range so its time counts as an op (the unprofiled timing runs bare)."""
    module = load_cpu_kernels()
    bare = {name: getattr(module, name) for name in KERNELS} if module is not None else {}
    for name, f in bare.items():
        def labelled(*args, _f=f, _label=f"tandem::{name}"):
            with record_function(_label):
                return _f(*args)
        setattr(module, name, labelled)
    try:
        yield
    finally:
        for name, f in bare.items():
            setattr(module, name, f)


def group_of(name: str) -> str:
    base = name.split("::")[-1]
    for g, keys in GROUPS:
        if any(k in base for k in keys):
            return g
    return "other"


def table(prof, passes: int) -> list[tuple[str, float, int]]:
    """(group, self CPU ms per pass, op calls per pass), only leaf aten ops counted."""
    acc: dict[str, list[float]] = {}
    for e in prof.key_averages():
        if not e.key.startswith(("aten::", "mkldnn::", "tandem::")):
            continue
        if e.self_cpu_time_total <= 0:
            continue
        g = acc.setdefault(group_of(e.key), [0.0, 0])
        g[0] += e.self_cpu_time_total / 1e3 / passes
        g[1] += e.count / passes
    return sorted(((g, ms, int(n)) for g, (ms, n) in acc.items()), key=lambda r: -r[1])


def run(label: str, fn, passes: int) -> None:
    fn()  # warm
    t = time.perf_counter()
    for _ in range(passes):
        fn()
    wall = (time.perf_counter() - t) / passes * 1e3
    with cpu_kernels_shown(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(passes):
            fn()
    rows = table(prof, passes)
    ops = sum(r[2] for r in rows)
    print(f"\n{label}: {wall:.1f} ms per pass (unprofiled), {ops} ops per pass")
    print(f"| op group | ms per pass | ops |\n|---|---|---|")
    for g, ms, n in rows:
        print(f"| {g} | {ms:.1f} | {n} |")
    print(f"| (op self time total) | {sum(r[1] for r in rows):.1f} | {ops} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=16)
    ap.add_argument("--passes", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = load_engine("smollm2-135m", dtype=args.dtype, kv_bytes=256 << 20)
    params = SamplingParams(max_tokens=64, ignore_eos=True)  # room for a batch of 32 in the pool; steps stay at `context`
    seqs = [engine.new_sequence(f"d{i}", [1 + i] * args.context, params) for i in range(args.batch)]
    for s in seqs:
        engine.admit(s)
    engine.prefill(seqs)

    def decode():
        engine.decode_step(seqs)
        for s in seqs:  # stay at the same context: forget the token just made
            s.output_ids.pop()
            s.num_cached -= 1

    run(f"decode step, batch {args.batch}, context {args.context}, {args.dtype}", decode, args.passes)
    prompt = [1 + (7 * i) % 1000 for i in range(args.prefill_len)]

    def prefill():
        seq = engine.new_sequence("p", prompt, SamplingParams(max_tokens=1))
        engine.admit(seq)
        engine.prefill([seq])
        engine.release(seq)

    run(f"prefill pass, {args.prefill_len} tokens, {args.dtype}", prefill, args.passes)


if __name__ == "__main__":
    main()
