"""Attention over a packed batch, in the two shapes the roles need.

A packed batch is all tokens of all sequences in one `[T, ...]` tensor, sequence after sequence.
- `PrefillAttention`: fresh prompts, nothing cached. Each sequence attends causally to itself; its new
  K/V go to a `KVWriter` (the local pool, or a transport into another worker's pool).
- `PagedAttention`: tokens that continue a sequence whose earlier K/V sit in the local pool (decode
  steps, prompt chunks). New K/V are written to the pool first, then each sequence's whole context
  is gathered from its pages.
`TeeAttention` also hands new K/V to writers; `StoppableAttention` ends a pass nobody waits for.
A pass of up to a few hundred rows whose attention reads the pool in place runs every layer in one call
(`in_place_rows`, engine/cpu_kernels/layers.py).
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from engine.cpu_kernels import attention as cpu_attention
from engine.kv_pool import KVCache
from engine.rope import apply_rotary


class KVWriter(Protocol):
    """Receives one sequence's new K/V, layer by layer, during a prefill pass.

    `write_layer` may start an asynchronous copy and return at once (so the copy overlaps the next
    layer's compute); the tensors it is given are not modified afterwards. The caller of the pass
    calls `finish`, which returns only when every layer has landed.
    """

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None: ...

    def finish(self) -> None: ...


class PoolWriter:
    """Writes a sequence's K/V into the local pool at the slots of its positions."""

    def __init__(self, cache: KVCache, slots: torch.Tensor):
        self.cache = cache
        self.slots = slots  # [L] flat slot per token

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        self.cache.write(layer, k, v, self.slots[start:start + k.shape[0]])

    def finish(self) -> None:
        return None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """q: [B, H, Q, hd], k/v: [B, Hkv, L, hd] -> [B, H, Q, hd]; grouped-query heads share K/V."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)


class Attention:
    """What the model's layers call. `attend` takes rotated q and k; `attend_qkv` takes one layer's fused
    projections before the rotary embedding, so an attention that can do the rotation and the K/V write in
    the same call as the attention (PagedAttention on CPU) does."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, hd], k/v: [T, Hkv, hd] -> [T, H * hd]."""
        raise NotImplementedError

    def in_place_rows(self) -> tuple | None:
        """(pool, slots [T], tables [T, P], ctx_lens [T]) when every row of this pass can attend over the pool
        in place with Tandem's CPU kernel, as if each row were its own sequence: a decode row over its
        context, a prompt row over the keys up to its own position (causal), its K/V written first
        (engine/cpu_kernels/layers.py then runs such a pass through every layer in one call); None
        otherwise."""
        return None

    def in_place_layer_done(self) -> Callable[[int], None] | None:
        """For a pass that `in_place_rows` let run in one call: what to call with each layer's index once
        its new K/V are in the pool (None: nothing). What it raises ends the pass."""
        return None

    def attend_qkv(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        """qkv: [T, H + 2*Hkv, hd] (q, k, v heads; H = `heads`), cos/sin: [T, 1, hd] -> [T, H * hd]."""
        kv_heads = (qkv.shape[1] - heads) // 2
        qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)  # [T, H + Hkv, hd]: q and k rotated in one go
        return self.attend(layer, qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:])


class PrefillAttention(Attention):
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


class TeeAttention(Attention):
    """Any attention, with each sequence's new K/V also handed to a writer (a prompt prefilled in
    chunks against a local pool, while its pages stream to the decode worker chunk by chunk)."""

    def __init__(self, inner, q_lens: list[int], writers: list[KVWriter], starts: list[int]):
        self.inner = inner
        self.parts = []
        offset = 0
        for n, w, start in zip(q_lens, writers, starts):
            self.parts.append((offset, offset + n, w, start))
            offset += n

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for a, b, writer, start in self.parts:
            writer.write_layer(layer, k[a:b], v[a:b], start)
        return self.inner.attend(layer, q, k, v)

    def in_place_rows(self) -> tuple | None:
        """The inner PagedAttention's: in one call the writers get each layer's new K/V from the pool."""
        return self.inner.in_place_rows()

    def in_place_layer_done(self) -> Callable[[int], None]:
        return self._hand_over

    def _hand_over(self, layer: int) -> None:
        kv = self.inner.cache.layer_kv(layer).flatten(1, 2)  # [2, pages * tpp, Hkv, hd]
        for a, b, writer, start in self.parts:
            new = kv[:, self.inner.slots[a:b]]  # [2, n, Hkv, hd]: a copy, the writer may keep it
            writer.write_layer(layer, new[0], new[1], start)


class PassStopped(Exception):
    """The pass was given up between two layers (its requests, or most of them, went away). Nothing it
    computed is valid: no sequence advanced, and the K/V it wrote past their cached tokens are junk."""


class StoppableAttention(Attention):
    """Any attention, checking `stop()` before each layer and raising PassStopped once it is true (a
    long prompt chunk whose client left frees its pages now, not when the pass would have ended). A pass
    whose last layer is computed is never given up: its live requests keep what it computed."""

    def __init__(self, inner, stop):
        self.inner, self.stop = inner, stop
        self._layers = 0  # of a pass in one call (its pool's first dimension)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.stop():
            raise PassStopped(f"pass stopped before layer {layer}: its requests were aborted")
        return self.inner.attend(layer, q, k, v)

    def in_place_rows(self) -> tuple | None:
        """The inner attention's; a pass in one call is checked before it starts and after each layer but
        the last (as the layer loop checks before each)."""
        if self.stop():
            raise PassStopped("pass stopped before it started: its requests were aborted")
        rows = self.inner.in_place_rows()
        self._layers = 0 if rows is None else rows[0].shape[0]
        return rows

    def in_place_layer_done(self) -> Callable[[int], None]:
        inner = self.inner.in_place_layer_done()

        def done(layer: int) -> None:
            if inner is not None:
                inner(layer)
            if layer + 1 < self._layers and self.stop():
                raise PassStopped(f"pass stopped after layer {layer}: its requests were aborted")
        return done


def _padded(tables: list[list[int]], longest: int, tpp: int, dev) -> torch.Tensor:
    """Page tables [B, P] as wide as the longest context needs, padded with a page the sequence owns (keys
    there are masked out or never read)."""
    width = -(-longest // tpp)
    return torch.tensor([t[:width] + [t[0]] * (width - min(len(t), width)) for t in tables], device=dev)


class PagedAttention(Attention):
    """Each sequence b brings q_lens[b] new tokens and has ctx_lens[b] tokens after them (cached + new).

    Decode rows (one new token) attend as one batch over their gathered pages; a prompt chunk (several
    new tokens) attends on its own, so decode rows are never padded to a chunk's length. On CPUs where
    Tandem's kernel applies (engine/cpu_kernels/attention.py), decode rows read the pool in place instead
    of gathering it.
    """

    def __init__(self, cache: KVCache, page_tables: list[list[int]], q_lens: list[int], ctx_lens: list[int]):
        self.cache = cache
        tpp = cache.layout.tokens_per_page
        dev = cache.device
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        self.total = starts[-1]
        slots = [t[p // tpp] * tpp + p % tpp for t, n, c in zip(page_tables, q_lens, ctx_lens) for p in range(c - n, c)]
        self.slots = torch.tensor(slots, device=dev)  # [T] where each new token's K/V go (one tensor made per pass)
        dec = [b for b, n in enumerate(q_lens) if n == 1]
        self.decode_rows = torch.tensor([starts[b] for b in dec], device=dev)  # [Bd] rows of the packed batch
        self.kernel = cpu_attention.supports(cache.data)
        self.in_place = bool(dec) and self.kernel
        self.page_tables, self.q_lens, self.ctx_lens = page_tables, q_lens, ctx_lens
        if self.in_place:  # (page tables [Bd, P], context lengths [Bd]) for the kernel: no gather, no mask
            self.decode = (_padded([page_tables[b] for b in dec], max(ctx_lens[b] for b in dec), tpp, dev),
                           torch.tensor([ctx_lens[b] for b in dec], device=dev))
        else:
            self.decode = self._group([page_tables[b] for b in dec], [1] * len(dec), [ctx_lens[b] for b in dec], dev)
        self.starts = starts
        self.all_decode = len(dec) == len(q_lens)

    @functools.cached_property
    def chunks(self) -> list[tuple[int, int, tuple]]:
        """(first row, end row, group) of each prompt chunk, made when a layer first attends (a pass that
        runs in one call never needs their masks)."""
        dev, starts = self.cache.device, self.starts
        return [(starts[b], starts[b + 1], self._group([self.page_tables[b]], [n], [self.ctx_lens[b]], dev))
                for b, n in enumerate(self.q_lens) if n > 1]

    def _group(self, tables: list[list[int]], q_lens: list[int], ctx_lens: list[int], dev):
        """(page tables [B, P], additive mask [B, 1, Q, P * tpp]: 0 where a query sees a key, -inf
        elsewhere) for sequences attended together. Made once per pass in the pool's dtype, so no layer
        converts a boolean mask again."""
        if not tables:
            return None
        tpp = self.cache.layout.tokens_per_page
        padded = _padded(tables, max(ctx_lens), tpp, dev)  # [B, P]
        keys = torch.arange(padded.shape[1] * tpp, device=dev)  # [L] key positions
        q = max(q_lens)
        qpos = torch.tensor([c - n for n, c in zip(q_lens, ctx_lens)], device=dev)[:, None] + \
            torch.arange(q, device=dev)[None, :]  # [B, Q] absolute position of each query
        hidden = (keys[None, None, :] > qpos[:, :, None])[:, None]  # [B, 1, Q, L]
        mask = torch.zeros(hidden.shape, dtype=self.cache.data.dtype, device=dev).masked_fill_(hidden, float("-inf"))
        return padded, mask  # [B, P], [B, 1, Q, L]

    def in_place_rows(self) -> tuple | None:
        if not self.kernel:
            return None
        if self.all_decode:
            return (self.cache.data, self.slots, *self.decode)
        tpp, dev = self.cache.layout.tokens_per_page, self.cache.device
        tables = _padded(self.page_tables, max(self.ctx_lens), tpp, dev)  # [B, P]
        rows = torch.cat([t.expand(n, -1) for t, n in zip(tables, self.q_lens)])  # [T, P]: each row its sequence's
        lens = torch.cat([torch.arange(c - n + 1, c + 1, device=dev) for n, c in zip(self.q_lens, self.ctx_lens)])
        return self.cache.data, self.slots, rows, lens  # lens [T]: row i of a prompt chunk sees one key more than row i - 1

    def attend_qkv(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        """As Attention.attend_qkv; a pass of decode rows only, read in place, goes to the CPU kernel's one
        call (rotation, K/V write and attention)."""
        if not (self.in_place and self.all_decode):
            return super().attend_qkv(layer, qkv, cos, sin, heads)
        tables, lens = self.decode
        return cpu_attention.decode_step(qkv, cos.flatten(1), sin.flatten(1), self.cache.layer_kv(layer), self.slots,
                                         tables, lens)  # [T, H * hd]

    def _decode_rows(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [Bd, H, hd], one row per decode sequence -> [Bd, H * hd]."""
        if self.in_place:
            tables, lens = self.decode
            return cpu_attention.decode(q, self.cache.layer_kv(layer), tables, lens).flatten(1)
        return self._attend(layer, self.decode, q[:, :, None, :]).flatten(1)  # [Bd, H, 1, hd] -> [Bd, H*hd]

    def _attend(self, layer: int, group, q: torch.Tensor) -> torch.Tensor:
        """q: [B, H, Q, hd] -> [B, H, Q, hd] over the group's gathered pages."""
        tables, mask = group
        kc, vc = self.cache.gather_pages(layer, tables)  # [B, L, Hkv, hd] each
        k, v = kc.transpose(1, 2), vc.transpose(1, 2)  # [B, Hkv, L, hd]
        B, H, Q, hd = q.shape
        Hkv = k.shape[1]
        if Q == 1 and H != Hkv and q.dtype != torch.float32:
            # One position per sequence: the query heads that share a KV head are that head's queries, under
            # the same mask. On CPU, SDPA's bf16 kernel with grouped heads measured ~8x slower than this
            # (fp32 is not: it keeps the grouped call, bit for bit as before).
            out = F.scaled_dot_product_attention(q.view(B, Hkv, H // Hkv, hd), k, v, attn_mask=mask)  # [B, Hkv, H/Hkv, hd]
            return out.view(B, H, 1, hd)
        return _sdpa(q, k, v, attn_mask=mask)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, hd], k/v: [T, Hkv, hd] -> [T, H * hd]."""
        self.cache.write(layer, k, v, self.slots)
        T, H, hd = q.shape
        if self.all_decode:
            return self._decode_rows(layer, q)  # [T, H*hd]
        out = q.new_empty(T, H * hd)
        if self.decode is not None:
            rows = self.decode_rows
            out[rows] = self._decode_rows(layer, q[rows])
        for a, b, group in self.chunks:
            o = self._attend(layer, group, q[a:b].transpose(0, 1)[None])  # [1, H, n, hd]
            out[a:b] = o[0].transpose(0, 1).reshape(b - a, H * hd)
        return out
