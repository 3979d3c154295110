"""Matrix products of a few rows on AVX-512 or AVX2 CPUs (gemv.cpp): y [M, out] = x [M, in] @ W.T, W packed once.

A decode step of one sequence is one such product per weight, bound by memory bandwidth; a small decode
batch and a short prompt are still near that bound, and up to ~64 rows the products are short enough
that a library GEMM's blocking costs more than it saves. `pack` lays W out in panels of 16 output rows
(fp32 [out/16, in, 16], bf16 [out/16, in/2, 16, 2]) so the kernel streams each panel in order and adds
one broadcast value of x into 16 outputs per instruction, with no horizontal sums. Measured on a 2-core
Sapphire Rapids over the default model's products (30 layers, weights from memory): one row reads the
weight 1.2-1.4x faster than the previous row-major kernel, 16 fp32 rows run ~1.5x faster, and 8 to 64
fp32 rows beat oneDNN's blocked-weight linear by 1.1-1.5x (and match it up to 2048 rows on a later
host); in bf16 oneDNN's AMX kernel is ~10% faster at 16 rows and far ahead past that. From 7 to 48
rows each block is taken in chunks that stay in L1 while the next is prefetched (gemv.cpp): the
weight's arrival overlaps the arithmetic, 10-15% off 16- and 32-row products.
A row's result is the same bits whatever the number of rows beside it (and the same on either instruction
set: simd16.h). It applies to fp32 weights and bf16 ones (`takes`) whose row count is a multiple of 16
(bf16: inner size even).
"""

from __future__ import annotations

import torch

from engine.cpu_kernels.build import cpu_flags, isa, load

LANES = 16  # output rows per panel (gemv.cpp: kLanes)


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear takes this dtype here: fp32 wherever PyTorch has oneDNN; bf16 only on CPUs
    with its bf16 instructions (AVX512-BW/VL/DQ or AVX-NE-CONVERT: not an AVX2-only CPU, where its
    weight reorder raises). Where it takes bf16, PyTorch has a fast bf16 product of many rows; elsewhere
    every bf16 product is the kernel's (`ROWS_FASTER`; engine/cpu_kernels/layers.py)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


# Up to how many rows `gemv` takes a product (engine/linear.py: Dense). fp32: every row count: on the
# Intel host of round 8 (docs/benchmarks/engine) the packed kernel matched or beat oneDNN's blocked
# linear and MKL at every row count measured (scripts/bench_products.py shapes, alternating medians: 64
# rows 54 / 70 / 74 ms, 512: 343 / 362 / 366, 2048: 1415 / 1578 / 1382), and a whole 1024- or 2048-row
# prompt pass took the same time either way (1222 / 1266 and 2666 / 2625 ms), so an fp32 layer needs no
# oneDNN copy of its weight. (On the AMD host of rounds 1-2 oneDNN led by 15-20% past 1024 rows.) bf16
# stops at 16, not at the 8 where oneDNN's AMX products start to win: a pass of 9-16 rows then runs every
# layer in one call (engine/cpu_kernels/layers.py), which saves more than the products lose (measured side
# by side: a 16-token bf16 prompt pass 69 -> 53 ms, a batch-12 decode step 67 -> 52 ms;
# scripts/bench_products.py: 16 rows 37.4 ms packed, 34.6 oneDNN).
# Where PyTorch has no fast bf16 product (oneDNN's needs AVX512-BW or AVX-NE-CONVERT: not on an AVX2 CPU)
# bf16 goes to the kernel at every row count too: measured on a 2-core AMD EPYC (docs/benchmarks/engine,
# round 13) with bf16 past 16 rows left to PyTorch, a 512-token prompt ran at 84 tokens/s against 588 in fp32.
EVERY_ROW_COUNT = 1 << 62
ROWS_FASTER = {torch.float32: EVERY_ROW_COUNT,
               torch.bfloat16: 16 if onednn_takes(torch.bfloat16) else EVERY_ROW_COUNT}
_PAIR = {torch.float32: 1, torch.bfloat16: 2}  # values of `in` per step of the kernel


def supports(weight: torch.Tensor) -> bool:
    """True if `pack` and `gemv` can take this weight: [out, in] on CPU, fp32 or bf16, out a multiple of
    16 (bf16: in even), the CPU has the instructions and the kernels load (built on first use)."""
    dt = weight.dtype
    return (weight.device.type == "cpu" and weight.dim() == 2 and dt in _PAIR and weight.shape[0] % LANES == 0
            and weight.shape[1] % _PAIR[dt] == 0 and takes(dt) and load() is not None)


def takes(dtype: torch.dtype) -> bool:
    """Whether this CPU's build multiplies this dtype: fp32 in either; bf16 with AVX2 (as fp32 multiply-adds)
    or with AVX512_BF16's dot products (an AVX-512 CPU without them leaves bf16 to oneDNN)."""
    if dtype == torch.bfloat16:
        return isa() == "avx2" or (isa() == "avx512" and "avx512_bf16" in cpu_flags())
    return dtype == torch.float32 and isa() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] that `supports` accepted -> a new tensor in the kernel's panel layout:
    fp32 [out/16, in, 16] with P[p, i, l] = W[16p + l, i]; bf16 [out/16, in/2, 16, 2] with
    P[p, j, l, t] = W[16p + l, 2j + t]."""
    out, inner = weight.shape
    pair = _PAIR[weight.dtype]
    panels = weight.reshape(out // LANES, LANES, inner // pair, pair).permute(0, 2, 1, 3)  # [out/16, in/pair, 16, pair]
    return (panels.squeeze(-1) if pair == 1 else panels).contiguous()


def gemv(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x: [M, in], M >= 1, of the weight's dtype; packed: `pack(W)` -> [M, out] = x @ W.T."""
    return load().gemv(x.contiguous(), packed)


def describe() -> str:
    dtypes = [str(dt).removeprefix("torch.") for dt in _PAIR if takes(dt)]
    return f"products of few rows in {', '.join(dtypes)}" if dtypes and load() else "few-row products: not in use"
