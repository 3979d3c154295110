"""A pass of a few rows through every decoder layer in one call (decode_layers.cpp).

Each row attends as if it were its own sequence: a decode row over its context, a prompt row over the
keys up to its own position (the kernel writes every row's K/V before any row attends, so a prompt's
rows see each other causally). For decode rows these are the kernels engine/model.py's layer loop
runs, in its order, so the result is bit for bit the loop's; prompt rows differ from the loop's PyTorch
attention only by rounding. What the call saves is the ~10 interpreted calls per layer between the
kernels (about a millisecond per decode step, ~20 ms of a 16-token fp32 prompt pass). It applies when
every product of every layer can use the few-row kernel (plain fp32/bf16 weights, no biases), the pass
has at most `max_rows` rows and its attention reads the pool in place (engine/attention.py:
Attention.in_place_rows).
"""

from __future__ import annotations

import torch

from engine.cpu_kernels import gemv, norm
from engine.cpu_kernels.build import load


def layer_weights(layers: list) -> list[torch.Tensor] | None:
    """The flat weight list `decode` takes (six per layer: attn_norm, qkv, o, mlp_norm, gate_up, down),
    or None when some product cannot go to the few-row kernel (engine/linear.py: Dense.packed)."""
    flat = []
    for L in layers:
        products = [getattr(d, "packed", None) for d in (L.qkv, L.o, L.gate_up, L.down)]
        if any(w is None for w in products) or load() is None:
            return None
        qkv, o, gate_up, down = products
        flat += [L.attn_norm, qkv, o, L.mlp_norm, gate_up, down]
    return flat


def max_rows(dtype: torch.dtype) -> int:
    """The most rows a pass may have to go through `decode`: as many as the layer loop would also send to
    the few-row products and the norm kernel (so both paths run the same kernels)."""
    return min(gemv.ROWS_FASTER.get(dtype, 0), norm.MAX_ROWS)


def decode(x: torch.Tensor, weights: list[torch.Tensor], in_place: tuple, cos: torch.Tensor, sin: torch.Tensor,
           heads: int, eps: float) -> torch.Tensor:
    """x: [B, D] (the pass's rows, embedded; updated in place) -> [B, D] after every layer and the last
    residual add. `weights` from `layer_weights`; `in_place`: (pool [layers, 2, pages, tpp, Hkv, hd],
    slots [B], tables [B, P], ctx_lens [B]: each row's own) from the pass's attention; cos, sin: [B, hd]."""
    pool, slots, tables, lens = in_place
    return load().decode_layers(x, weights, pool, cos, sin, slots, tables, lens, heads, eps)


def describe() -> str:
    return "whole-step decode of a few rows" if load() else "whole-step decode: not in use"
