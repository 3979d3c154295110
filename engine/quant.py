"""Weight-only int8 for the decode role: per-output-channel symmetric quantization and two kernels.

A quantized weight is stored as `W_q: [out, in] int8` plus `scale: [out] fp32` with W ~= W_q * scale.
- "int8": weight-only. Activations stay fp32; PyTorch's `_weight_int8pack_mm` CPU kernel.
- "int8-dynamic": the same stored weights, run by fbgemm's dynamic-quantized linear, which also
  quantizes each activation batch to 8 bits on the fly (per tensor). Much faster on x86 CPUs, a
  little less exact. Measured side by side by scripts/bench_quant.py.
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
    """y = x @ (W_q * scale).T with fp32 activations."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        self.q, self.scale, self.bias = q.contiguous(), scale.float().contiguous(), bias

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)  # [T, out]
        return y if self.bias is None else y + self.bias


class Int8Dynamic:
    """fbgemm dynamic-quantized linear over the same int8 weights (activations quantized per batch)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
        self.packed = torch.ops.quantized.linear_prepack(qw, bias.float() if bias is not None else None)
        self._nbytes = q.numel() + scale.numel() * 4

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)  # [T, in] -> [T, out]


def make_quantized(mode: str, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    if mode == "int8":
        return Int8WeightOnly(q, scale, bias)
    if mode == "int8-dynamic":
        if q.device.type != "cpu":
            raise ValueError("int8-dynamic runs on CPU (fbgemm); use weight_quant 'int8' or 'none' on GPU")
        return Int8Dynamic(q, scale, bias)
    raise ValueError(f"unknown weight quantization {mode!r}; allowed: {', '.join(QUANT_MODES)}")
