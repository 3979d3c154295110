"""Linear layers: dense (fp32/bf16/fp16) and weight-only int8 for the bandwidth-bound decode role."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Dense:
    """y = x @ W.T + b with W: [out, in].

    On CPU we call oneDNN's linear directly: PyTorch's default CPU GEMM (MKL) takes a generic code
    path on non-Intel CPUs, and oneDNN measured 1.2-1.5x faster for decode-sized batches (M = 1..32)
    on our AMD machines. Elsewhere (CUDA) it is plain `F.linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self._onednn = weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_available()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")  # [T, out]
        return F.linear(x, self.weight, self.bias)  # [T, in] -> [T, out]
