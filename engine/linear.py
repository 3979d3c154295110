"""Linear layers: dense (fp32/bf16/fp16) and weight-only int8 for the bandwidth-bound decode role."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cpu_kernels import gemv as cpu_gemv


class Dense:
    """y = x @ W.T + b with W: [out, in].

    On CPU (fp32, bf16), a product Tandem's kernel (below) does not take goes to oneDNN's linear, on a
    weight reordered once at load into oneDNN's blocked layout. PyTorch's default CPU GEMM (MKL) takes a
    generic code path on non-Intel CPUs, and a plain-layout weight is reordered by oneDNN on every call:
    one extra pass over the weight per matmul, which for a decode step (every weight read once) doubles
    its memory traffic.
    The reordered tensor is opaque (only oneDNN's linear can read it; its strides mean nothing), so
    `weight` is never read elsewhere (None where the packed copy is the only one).
    Elsewhere (CUDA, fp16, bf16 on a CPU without oneDNN's bf16 instructions) it is plain `F.linear`.

    Tandem's own kernel (engine/cpu_kernels/gemv.py) takes a product where it applies, on the weight
    packed for it: every fp32 product, and bf16 products of up to 16 rows (a decode step of a few
    sequences, a short prompt). It streams the weight once near the memory bandwidth where oneDNN's
    reaches ~0.65-0.8 of it at one row, and in fp32 runs at oneDNN's and MKL's rate or above at every row
    count measured (1 to 2048). So an fp32 layer the kernel takes holds only the packed weight; a bf16
    layer holds it twice, packed and reordered for oneDNN's AMX products of more rows. A tied head's
    embedding lookups read the packed copy (`rows`).
    """

    PACK_BATCH = 32  # the row count oneDNN tunes the layout for; any row count works with it

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()  # what one pass over the weight reads
        self.bias = bias
        cpu = weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
        self._packed = cpu_gemv.pack(weight) if cpu and cpu_gemv.supports(weight) else None
        self._few_rows = cpu_gemv.ROWS_FASTER.get(weight.dtype, 0)  # up to this many rows go to the kernel
        every_row = self._packed is not None and self._few_rows == cpu_gemv.EVERY_ROW_COUNT
        self._onednn = cpu and not every_row and cpu_gemv.onednn_takes(weight.dtype)
        if self._onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_BATCH)
        else:
            self.weight = None if every_row else weight  # the packed copy is the only one

    @property
    def packed(self) -> torch.Tensor | None:
        """The weight packed for Tandem's few-row kernel (engine/cpu_kernels/gemv.py: pack), when few-row
        products use it and the layer has no bias (engine/cpu_kernels/layers.py chains such layers in
        C++); else None."""
        return self._packed if self.bias is None else None

    @property
    def holds_rows(self) -> bool:
        """True if `rows` can read the weight's rows back (the layer keeps a packed copy)."""
        return self._packed is not None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] (int64) of the weight -> [T, in], a copy read out of the packed weight (needs
        `holds_rows`). A tied head's embedding lookups use it: the model need not keep the plain embedding."""
        panel, lane = ids // cpu_gemv.LANES, ids % cpu_gemv.LANES
        if self._packed.dim() == 3:  # fp32 [out/16, in, 16]
            return self._packed[panel, :, lane]  # [T, in]
        return self._packed[panel, :, lane, :].flatten(1)  # bf16 [out/16, in/2, 16, 2] -> [T, in/2, 2] -> [T, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and x.shape[0] <= self._few_rows:
            y = cpu_gemv.gemv(x, self._packed)  # [T, out]
            return y if self.bias is None else y.add_(self.bias)
        if self._onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")  # [T, out]
        return F.linear(x, self.weight, self.bias)  # [T, in] -> [T, out]
