"""RMSNorm of a decode step's few rows in one call, optionally after the residual add (rms_norm.cpp).

As PyTorch ops a norm is eight dispatches on a few hundred values, and a decode step has two per layer;
this is one call with the reference's rounding steps (only the fp32 sum's order differs). It applies to
contiguous fp32 and bf16 rows on CPU, up to `MAX_ROWS` of them (past that PyTorch's vectorized ops win).
"""

from __future__ import annotations

import torch

from engine.cpu_kernels.build import load

MAX_ROWS = 64  # measured (rows of 576, 2 threads): 1.3-9x faster than PyTorch's ops up to 64 rows, not at 128
_DTYPES = (torch.float32, torch.bfloat16)


def supports(x: torch.Tensor) -> bool:
    """True if `add_rms_norm` takes these rows: [T, D] contiguous on CPU, fp32 or bf16, T <= MAX_ROWS."""
    return (x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() == 2 and x.shape[0] <= MAX_ROWS
            and x.is_contiguous() and load() is not None)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] (updated in place: x += delta, when delta is given), weight: [D] -> [T, D] normed rows,
    for rows `supports` accepted; delta and weight of x's dtype."""
    return load().rms_norm(x, None if delta is None else delta.contiguous(), weight, eps)


def describe() -> str:
    return "decode norms in float32, bfloat16" if load() else "decode norms: not in use"
