"""Decode steps replayed from CUDA graphs captured at padded batch sizes.

A decode step launches a few hundred small kernels (30 layers of norms, matmuls, rotary, attention);
at small batches the GPU waits on the launches, not on memory. A graph records those launches once
and replays them with one call. A graph fixes every shape and address, so each step runs on static
buffers: `B` rows (the running batch padded up to the next captured size) by `P` pages of context
(the longest row's pages, padded up to a power of two). Graphs are captured lazily, the first time a
(B, P) pair is needed, and share one memory pool.

Per step the host does one upload (tokens, positions, KV slots and page tables packed in one int64
buffer, copied from pinned memory) and, after the replay, the caller's sampler does one download of
the sampled tokens. Nothing inside the graph reads a value back to the host.

Padding rows repeat row 0 (same token, position, slot and pages): they compute bit-identical K/V and
write them to row 0's own slot, so no page outside the batch is touched and row 0 keeps its value.

With `capture=False` the same static-buffer step runs eagerly (on CPU too), which lets the padding
and masking be checked against the ordinary decode path where no GPU is present.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import Attention, _sdpa
from engine.kv_pool import KVCache
from engine.model import LlamaModel


class _StaticDecodeAttention(Attention):
    """Decode attention over static buffers: slots [B], page tables [B, P], mask [B, 1, 1, P * tpp]."""

    def __init__(self, cache: KVCache, slots: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor):
        self.cache, self.slots, self.tables, self.mask = cache, slots, tables, mask

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, H, hd], k/v: [B, Hkv, hd] -> [B, H * hd]."""
        B, H, hd = q.shape
        self.cache.write(layer, k, v, self.slots)
        kc, vc = self.cache.gather_pages(layer, self.tables)  # [B, L, Hkv, hd] each
        o = _sdpa(q[:, :, None, :], kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=self.mask)  # [B, H, 1, hd]
        return o.reshape(B, H * hd)


@dataclass
class _Step:
    """The static buffers of one (B, P) shape, and its graph once captured."""

    host: torch.Tensor  # [B * (3 + P)] int64, pinned on CUDA: tokens, positions, slots, page tables
    meta: torch.Tensor  # the same on the device
    keys: torch.Tensor  # [P * tpp] key positions
    rows: torch.Tensor  # [B] 0..B-1: every row is a last row
    graph: object | None = None  # torch.cuda.CUDAGraph
    logits: torch.Tensor | None = None  # [B, V] written by each replay


def _next_size(n: int, sizes: tuple[int, ...]) -> int:
    return next(b for b in sizes if b >= n)


class DecodeGraphs:
    """Runs decode steps of up to max(batch_sizes) sequences on captured graphs (or eagerly)."""

    def __init__(self, model: LlamaModel, cache: KVCache, batch_sizes: tuple[int, ...] | list[int],
                 capture: bool = True):
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"CUDA graph batch sizes must be positive, got {list(batch_sizes)}")
        if capture and cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and KV pool on a CUDA device")
        if model.cfg.rope_scaling.type == "dynamic":
            raise ValueError("dynamic RoPE scaling picks frequencies per pass from the context length; "
                             "it cannot be replayed from a graph (load with cuda_graphs=False)")
        self.model, self.cache, self.capture = model, cache, capture
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        tpp = cache.layout.tokens_per_page
        self.max_pages = -(-model.cfg.max_position // tpp)
        self._steps: dict[tuple[int, int], _Step] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        model.rotary.cos_sin(torch.zeros(1, dtype=torch.long, device=cache.device), dtype=model.dtype,
                             max_len=model.cfg.max_position)  # builds the whole table before any capture

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (batch, pages) shapes that have a graph."""
        return sorted(k for k, s in self._steps.items() if s.graph is not None)

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.max_batch

    def page_width(self, pages: int) -> int:
        """Pages per row for a step whose longest row needs `pages`: the next power of two (capped)."""
        return min(1 << max(0, pages - 1).bit_length(), self.max_pages)

    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode step: token i at position i of the sequence whose pages are tables[i].

        Returns logits [n, V], a view of the step's static output: read it before the next step.
        """
        n = len(tokens)
        tpp = self.cache.layout.tokens_per_page
        B = _next_size(n, self.batch_sizes)
        P = self.page_width(max(p // tpp + 1 for p in positions))
        pad = B - n
        slots = [t[p // tpp] * tpp + p % tpp for t, p in zip(tables, positions)]
        flat = tokens + tokens[:1] * pad + positions + positions[:1] * pad + slots + slots[:1] * pad
        for t in tables + tables[:1] * pad:
            flat += t[:P] + [t[0]] * (P - min(len(t), P))  # pad with a page the row owns; masked out
        step = self._step(B, P)
        step.host.copy_(torch.tensor(flat, dtype=torch.int64))
        step.meta.copy_(step.host, non_blocking=True)  # the step's one upload
        if self.capture and step.graph is None:
            self._capture(step, B, P)
        if step.graph is not None:
            step.graph.replay()
            return step.logits[:n]
        return self._forward(step, B, P)[:n]

    def _forward(self, step: _Step, B: int, P: int) -> torch.Tensor:
        """The decode pass over the step's buffers -> logits [B, V]."""
        m = step.meta
        tokens, positions, slots = m[:B], m[B:2 * B], m[2 * B:3 * B]  # [B] each
        tables = m[3 * B:].view(B, P)  # [B, P]
        mask = (step.keys[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, P * tpp]
        attn = _StaticDecodeAttention(self.cache, slots, tables, mask)
        return self.model.forward(tokens, positions, positions + 1, attn, step.rows,
                                  max_len=self.model.cfg.max_position)

    def _step(self, B: int, P: int) -> _Step:
        step = self._steps.get((B, P))
        if step is not None:
            return step
        dev = self.cache.device
        size = B * (3 + P)
        host = torch.zeros(size, dtype=torch.int64, pin_memory=self.capture)
        step = _Step(host=host, meta=torch.zeros(size, dtype=torch.int64, device=dev),
                     keys=torch.arange(P * self.cache.layout.tokens_per_page, device=dev),
                     rows=torch.arange(B, device=dev))
        self._steps[(B, P)] = step
        return step

    def _capture(self, step: _Step, B: int, P: int) -> None:
        """Warm up on a side stream (the allocator and kernel choices settle), then record one pass.

        The buffers already hold this step's batch, so the warm-up passes write exactly the K/V the
        step itself writes (the same values to the same slots): no other page is touched."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(step, B, P)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a worker's other threads (a prefill on the same device) may keep launching work
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step.logits = self._forward(step, B, P)
        step.graph = graph
