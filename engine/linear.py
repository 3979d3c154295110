"""Linear layers: dense (fp32/bf16/fp16) and weight-only int8 for the bandwidth-bound decode role."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Dense:
    """y = x @ W.T + b with W: [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [T, in] -> [T, out]
