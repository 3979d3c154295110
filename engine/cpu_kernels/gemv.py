"""Decode-sized matrix products on AVX-512 CPUs (gemv.cpp): y [M, out] = x [M, in] @ W.T, 1 <= M <= 16.

A decode step of one sequence is one such product per weight, bound by memory bandwidth, and so are a
small decode batch and a short prompt. oneDNN's inner product reaches ~0.65-0.8 of a plain read's
bandwidth at one row and takes about as long for 2-8 rows as for 16; this kernel streams the plain
row-major weight once for all rows at about a plain read's bandwidth. A row's result is the same bits
whatever the number of rows beside it. It applies to fp32 (AVX-512F) and bf16 (AVX512_BF16) weights whose
row count is a multiple of 4 and inner size a multiple of 16 (fp32) or 32 (bf16).
"""

from __future__ import annotations

import torch

from engine.cpu_kernels.build import cpu_flags, load

MAX_ROWS = 16  # rows of x per call (gemv.cpp: kMaxRows)
# Up to how many rows `gemv` beats oneDNN's blocked-weight linear, measured on a 2-core Sapphire Rapids
# (the default model's products, fp32 ~1.1-1.4x at 1-16 rows; bf16 1.2-1.4x at 1-8 rows, past that
# oneDNN's AMX kernel wins).
ROWS_FASTER = {torch.float32: 16, torch.bfloat16: 8}
_ALIGN = {torch.float32: 16, torch.bfloat16: 32}  # inner size multiple: one 512-bit register of x
_CPU_FLAG = {torch.float32: "avx512f", torch.bfloat16: "avx512_bf16"}


def supports(weight: torch.Tensor) -> bool:
    """True if `gemv` can multiply by this weight: [out, in] contiguous on CPU, fp32 or bf16, shapes
    aligned, the CPU has the instructions and the kernels load (built on first use)."""
    dt = weight.dtype
    return (weight.device.type == "cpu" and weight.dim() == 2 and dt in _ALIGN and weight.is_contiguous()
            and weight.shape[0] % 4 == 0 and weight.shape[1] % _ALIGN[dt] == 0
            and _CPU_FLAG[dt] in cpu_flags() and load() is not None)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, in], 1 <= M <= MAX_ROWS -> [M, out] = x @ weight.T, for a weight `supports` accepted; x of
    the weight's dtype."""
    return load().gemv(x.contiguous(), weight)


def describe() -> str:
    dtypes = [str(dt).removeprefix("torch.") for dt, flag in _CPU_FLAG.items() if flag in cpu_flags()]
    return f"products of few rows in {', '.join(dtypes)}" if dtypes and load() else "few-row products: not in use"
