"""Decode attention straight out of the paged KV pool (decode_attention.cpp): one query row per sequence.

The gathered path (engine/attention.py) copies each sequence's context out of the pool every layer and
builds a mask for SDPA; for one row per sequence that costs more than the attention. This kernel reads
each key and value where its page table puts it. It applies to fp32 and bf16 pools on AVX-512F or AVX2
CPUs with a head size that is a multiple of 16 and at most 256.
"""

from __future__ import annotations

import torch

from engine.cpu_kernels.build import load

_DTYPES = (torch.float32, torch.bfloat16)


def supports(pool: torch.Tensor) -> bool:
    """True if `decode` can read this pool: [layers, 2, pages, tpp, kv_heads, head_dim] on CPU."""
    hd = pool.shape[-1]
    return (pool.device.type == "cpu" and pool.dtype in _DTYPES and pool.is_contiguous() and hd % 16 == 0
            and hd <= 256 and load() is not None)


def decode(q: torch.Tensor, layer_kv: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor) -> torch.Tensor:
    """q: [B, H, hd] (the pool's dtype); layer_kv: [2, pages, tpp, Hkv, hd] one layer of a pool `supports`
    accepted; tables: [B, P] int64 page ids; ctx_lens: [B] int64, 1 <= ctx_lens[b] <= P * tpp
    -> [B, H, hd]: each row attends to keys 0..ctx_lens[b]-1 of its own pages (they include its own,
    already written)."""
    return load().decode_attention(q, layer_kv, tables, ctx_lens)


def decode_step(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_kv: torch.Tensor,
                slots: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor) -> torch.Tensor:
    """A decode step's attention from unrotated projections, one row per sequence: qkv [B, H + 2*Hkv, hd]
    (q, k, v heads), cos/sin [B, hd] (engine/rope.py's tables) -> [B, H * hd]. Rotates q and k as
    engine/rope.apply_rotary does, writes k and v into `layer_kv` at `slots` [B], then `decode`."""
    return load().decode_step_attention(qkv, cos, sin, layer_kv, slots, tables, ctx_lens)


def describe() -> str:
    return "paged decode attention in float32, bfloat16" if load() else "paged decode attention: not in use"
