"""Attention over a packed batch, in the two shapes the roles need.

A packed batch is all tokens of all sequences in one `[T, ...]` tensor, sequence after sequence.
- `PrefillAttention`: fresh prompts, nothing cached. Each sequence attends causally to itself; its new
  K/V go to a `KVWriter` (the local pool, or a transport into another worker's pool).
- `PagedAttention`: tokens that continue a sequence whose earlier K/V sit in the local pool (decode
  steps, prompt chunks). New K/V are written to the pool first, then each sequence's whole context
  is gathered from its pages.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine.kv_pool import KVCache


class KVWriter(Protocol):
    """Receives one sequence's new K/V, layer by layer, during a prefill pass.

    `write_layer` may start an asynchronous copy and return at once (so the copy overlaps the next
    layer's compute); the tensors it is given are not modified afterwards. The caller of the pass
    calls `finish`, which returns only when every layer has landed.
    """

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def finish(self) -> None: ...


class PoolWriter:
    """Writes a sequence's K/V into the local pool at the slots of its positions."""

    def __init__(self, cache: KVCache, slots: torch.Tensor):
        self.cache = cache
        self.slots = slots  # [L] flat slot per token

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write(layer, k, v, self.slots)

    def finish(self) -> None:
        return None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """q: [B, H, Q, hd], k/v: [B, Hkv, L, hd] -> [B, H, Q, hd]; grouped-query heads share K/V."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)


class PrefillAttention:
    def __init__(self, seq_lens: list[int], writers: list[KVWriter]):
        self.ranges = []
        start = 0
        for n in seq_lens:
            self.ranges.append((start, start + n))
            start += n
        self.writers = writers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, hd], k/v: [T, Hkv, hd] -> [T, H * hd]."""
        outs = []
        for (s, e), writer in zip(self.ranges, self.writers):
            writer.write_layer(layer, k[s:e], v[s:e])
            qi = q[s:e].transpose(0, 1)[None]  # [1, H, L, hd]
            ki = k[s:e].transpose(0, 1)[None]  # [1, Hkv, L, hd]
            vi = v[s:e].transpose(0, 1)[None]
            oi = _sdpa(qi, ki, vi, is_causal=True)  # [1, H, L, hd]
            outs.append(oi[0].transpose(0, 1).reshape(e - s, -1))  # [L, H*hd]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class PagedAttention:
    """Each sequence b brings q_lens[b] new tokens and has ctx_lens[b] tokens after them (cached + new)."""

    def __init__(self, cache: KVCache, page_tables: list[list[int]], q_lens: list[int], ctx_lens: list[int]):
        dev = cache.device
        tpp = cache.layout.tokens_per_page
        self.cache = cache
        self.q_lens = q_lens
        self.decode_only = all(n == 1 for n in q_lens)
        width = max(-(-c // tpp) for c in ctx_lens)  # pages needed by the longest context
        # [B, P] page ids, padded with a page the sequence owns (its keys there are masked out)
        self.tables = torch.tensor([t[:width] + [t[0]] * (width - min(len(t), width)) for t in page_tables],
                                   device=dev)
        pos = torch.arange(width * tpp, device=dev)  # [L] key positions in the gathered pages
        ctx = torch.tensor(ctx_lens, device=dev)
        ql = torch.tensor(q_lens, device=dev)
        q_max = max(q_lens)
        rows = torch.arange(q_max, device=dev)
        qpos = (ctx - ql)[:, None] + rows[None, :]  # [B, Q] absolute position of each query
        qpos = torch.where(rows[None, :] < ql[:, None], qpos, 0)  # padding queries see one key, not none
        self.mask = (pos[None, None, :] <= qpos[:, :, None])[:, None]  # [B, 1, Q, L]
        slot = self.tables[:, pos // tpp] * tpp + pos % tpp  # [B, L] flat slot of each key position
        self.slots = torch.cat([slot[b, c - n:c] for b, (n, c) in enumerate(zip(q_lens, ctx_lens))])  # [T]
        # rows of the padded [B, Q] query grid that hold real tokens, in packed order
        self.real = (rows[None, :] < ql[:, None]).flatten().nonzero().squeeze(1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, hd], k/v: [T, Hkv, hd] -> [T, H * hd]."""
        self.cache.write(layer, k, v, self.slots)
        kc, vc = self.cache.gather_pages(layer, self.tables)  # [B, L, Hkv, hd] each
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)  # [B, Hkv, L, hd]
        B, H, hd = len(self.q_lens), q.shape[1], q.shape[2]
        if self.decode_only:
            qp = q[:, :, None, :]  # [B, H, 1, hd]
        else:
            grid = q.new_zeros(B * self.mask.shape[2], H, hd)  # [B*Q, H, hd]
            grid[self.real] = q
            qp = grid.view(B, -1, H, hd).transpose(1, 2)  # [B, H, Q, hd]
        out = _sdpa(qp, kc, vc, attn_mask=self.mask)  # [B, H, Q, hd]
        out = out.transpose(1, 2).reshape(-1, H * hd)  # [B*Q, H*hd]
        return out if self.decode_only else out[self.real]
