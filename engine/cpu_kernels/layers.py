"""A batch-1 decode step through every decoder layer in one call (decode_layers.cpp).

The same kernels in the same order as engine/model.py's layer loop takes for one decode row, so the
result is bit for bit the loop's; it saves the ~10 interpreted calls per layer between them (about a
millisecond per step, a sixth to a quarter of a small model's bf16 step). It applies when every
product of every layer can use the one-row kernel (plain fp32/bf16 weights, no biases) and the pass's
attention reads the pool in place (engine/attention.py: PagedAttention.in_place_decode).
"""

from __future__ import annotations

import torch

from engine.cpu_kernels.build import load


def layer_weights(layers: list) -> list[torch.Tensor] | None:
    """The flat weight list `decode` takes (six per layer: attn_norm, qkv, o, mlp_norm, gate_up, down),
    or None when some product cannot go to the one-row kernel (engine/linear.py: Dense.row_weight)."""
    flat = []
    for L in layers:
        products = [getattr(d, "row_weight", None) for d in (L.qkv, L.o, L.gate_up, L.down)]
        if any(w is None for w in products) or load() is None:
            return None
        qkv, o, gate_up, down = products
        flat += [L.attn_norm, qkv, o, L.mlp_norm, gate_up, down]
    return flat


def decode(x: torch.Tensor, weights: list[torch.Tensor], in_place: tuple, cos: torch.Tensor, sin: torch.Tensor,
           heads: int, eps: float) -> torch.Tensor:
    """x: [1, D] (one decode row's embedding; updated in place) -> [1, D] after every layer and the last
    residual add. `weights` from `layer_weights`; `in_place`: (pool [layers, 2, pages, tpp, Hkv, hd],
    slots [1], tables [1, P], ctx_lens [1]) from the pass's attention; cos, sin: [1, hd]."""
    pool, slots, tables, lens = in_place
    return load().decode_layers(x, weights, pool, cos, sin, slots, tables, lens, heads, eps)


def describe() -> str:
    return "whole-step batch-1 decode" if load() else "whole-step batch-1 decode: not in use"
