"""Paged decode attention in half precision: a decode row's query heads attended as their KV head's queries
(engine/attention.py) give what grouped-query attention gives, over pages gathered from a real pool."""

from __future__ import annotations

import torch

from engine.attention import PagedAttention
from engine.kv_pool import KVCache
from tandem.kv_layout import KVLayout

H, HKV, HD, TPP = 9, 3, 64, 16  # the default model's heads


def _decode_attention(dtype: str, k_all, v_all, q, ctx_lens, tables):
    """Write every sequence's context into a pool of `dtype`, then attend one decode row per sequence."""
    cache = KVCache(KVLayout(1, HKV, HD, dtype, TPP), num_pages=16)
    for b, n in enumerate(ctx_lens):
        slots = torch.tensor([tables[b][p // TPP] * TPP + p % TPP for p in range(n - 1)])
        cache.write(0, k_all[b][:n - 1].to(cache.data.dtype), v_all[b][:n - 1].to(cache.data.dtype), slots)
    attn = PagedAttention(cache, tables, [1] * len(ctx_lens), ctx_lens)
    k_new = torch.stack([k_all[b][n - 1] for b, n in enumerate(ctx_lens)]).to(cache.data.dtype)  # [B, Hkv, hd]
    v_new = torch.stack([v_all[b][n - 1] for b, n in enumerate(ctx_lens)]).to(cache.data.dtype)
    return attn.attend(0, q.to(cache.data.dtype), k_new, v_new).float()  # [B, H * hd]


def test_half_precision_decode_attention_equals_grouped_query_attention():
    torch.manual_seed(0)
    ctx_lens, tables = [5, 40, 17], [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    k_all = [torch.randn(48, HKV, HD) for _ in ctx_lens]  # [L, Hkv, hd] per sequence
    v_all = [torch.randn(48, HKV, HD) for _ in ctx_lens]
    q = torch.randn(len(ctx_lens), H, HD)  # [B, H, hd]: one decode row each
    ref = _decode_attention("float32", k_all, v_all, q, ctx_lens, tables)
    for b, n in enumerate(ctx_lens):  # the fp32 path is grouped-query attention over the first n positions
        k = k_all[b][:n].transpose(0, 1).repeat_interleave(H // HKV, 0)  # [H, n, hd]
        v = v_all[b][:n].transpose(0, 1).repeat_interleave(H // HKV, 0)
        w = torch.softmax(q[b][:, None, :] @ k.transpose(1, 2) / HD ** 0.5, dim=-1)  # [H, 1, n]
        assert torch.allclose(ref[b], (w @ v).reshape(-1), atol=1e-5)
    for dtype in ("bfloat16", "float16"):
        got = _decode_attention(dtype, k_all, v_all, q, ctx_lens, tables)
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=0.05, rtol=0.05), (dtype, (got - ref).abs().max())
