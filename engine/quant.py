"""Weight-only int8 for the decode role: per-output-channel symmetric quantization and two kernels.

A quantized weight is stored as `W_q: [out, in] int8` plus `scale: [out] fp32` with W ~= W_q * scale.
- "int8": weight-only. Activations stay fp32; PyTorch's `_weight_int8pack_mm` CPU kernel.
- "int8-dynamic": the same stored weights; each activation row is also quantized to 8 bits on the
  fly and the product runs as an int8 GEMM. Faster on x86 CPUs, less exact. Measured side by side
  (speed and perplexity) by scripts/bench_quant.py.
"""

from __future__ import annotations

import torch

QUANT_MODES = ("none", "int8", "int8-dynamic")
SCALE_SUFFIX = "_scale"


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] float -> (w_q: [out, in] int8, scale: [out] fp32), symmetric per output channel."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return q, scale


class Int8WeightOnly:
    """y = x @ (W_q * scale).T with fp32 activations.

    PyTorch's int8 matrix-vector kernel is used for the few rows of a decode step; for larger
    passes (measured minutes for a 2k-token pass) the weight is dequantized and run through the
    fp32 GEMM, which computes the same product.
    """

    MAX_KERNEL_ROWS = 4

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        self.q, self.scale, self.bias = q.contiguous(), scale.float().contiguous(), bias

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.MAX_KERNEL_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)  # [T, out]
            return y if self.bias is None else y + self.bias
        w = self.q.to(x.dtype) * self.scale[:, None].to(x.dtype)  # [out, in]
        return torch.nn.functional.linear(x, w, self.bias)


class Int8Dynamic:
    """int8 x int8 GEMM: each activation row is quantized to int8 on the fly (its own scale), the
    product accumulates in int32 (`torch._int_mm`), and both scales are applied to the result."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        self.q_t = q.t().contiguous()  # [in, out] int8
        self.scale = scale.float()  # [out]
        self.bias = bias

    @property
    def nbytes(self) -> int:
        return self.q_t.numel() + self.scale.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0  # [T, 1] per-row scale
        xq = torch.round(x / xs).to(torch.int8)  # [T, in]
        y = torch._int_mm(xq, self.q_t).to(x.dtype) * (xs * self.scale)  # [T, out]
        return y if self.bias is None else y + self.bias


def make_quantized(mode: str, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    if mode == "int8":
        return Int8WeightOnly(q, scale, bias)
    if mode == "int8-dynamic":
        return Int8Dynamic(q, scale, bias)
    raise ValueError(f"unknown weight quantization {mode!r}; allowed: {', '.join(QUANT_MODES)}")
