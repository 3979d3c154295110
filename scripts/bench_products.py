#!/usr/bin/env python3
"""The decoder's matrix products at a given row count: Tandem's packed-weight kernel against oneDNN's
blocked-weight linear (what `engine/linear.py: Dense` chooses between) and PyTorch's default (MKL).

Each measurement runs every product of every layer of the default model's shapes once, on weights that
do not fit in cache (as in a real step, where each weight comes from memory), best of `--repeats`.
`engine/cpu_kernels/gemv.py: ROWS_FASTER` comes from this table.

    python scripts/bench_products.py [--dtype float32] [--rows 1,4,8,16,32,64,128] [--layers 30]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.cpu_kernels import gemv
from engine.cpu_kernels.gemv import onednn_takes

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [out, in]


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,4,8,16,32,64,128")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    plain = [[torch.randn(s).to(dtype) for s in SHAPES] for _ in range(args.layers)]
    if not all(gemv.supports(w) for w in plain[0]):
        raise SystemExit("Tandem's kernel does not apply here (needs AVX-512 or AVX2, with AVX-512 for bf16 "
                         "AVX512_BF16, and the built kernels)")
    packed = [[gemv.pack(w) for w in ws] for ws in plain]
    onednn = onednn_takes(dtype)  # not bf16 on an AVX2 CPU
    blocked = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] for ws in plain] if onednn else []
    print(f"{args.dtype}, {args.layers} layers x {len(SHAPES)} products, {args.threads} threads; ms (GFLOP/s)")
    print("| rows | Tandem (packed) | oneDNN (blocked) | PyTorch default |\n|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, s[1]).to(dtype) for s in SHAPES]
        runs = {
            "packed": lambda: [gemv.gemv(x, w) for ws in packed for x, w in zip(xs, ws)],
            "blocked": lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                for ws in blocked for x, w in zip(xs, ws)],
            "default": lambda: [F.linear(x, w) for ws in plain for x, w in zip(xs, ws)],
        }
        if not onednn:
            del runs["blocked"]
        gflop = 2 * rows * sum(o * i for o, i in SHAPES) * args.layers / 1e9
        cells = [f"{ms:.1f} ({gflop / ms * 1e3:.0f})" for ms in (best_ms(f, args.repeats) for f in runs.values())]
        if not onednn:
            cells.insert(1, "-")
        print(f"| {rows} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
