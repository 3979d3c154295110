"""The pieces a prefill worker (engine/workers/prefill_worker.py) moves through its queue: one queued request,
the writer that slows a real transport down (fault injection), and sending cached pages a destination lacks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.kv_pool import KVCache
from engine.sequence import Sequence
from engine.transports import LayerWriter
from engine.workers.sink import Responder
from tandem.wire import Prefill


class SlowWriter:
    """Fault injection (tests, `tandem chaos`): a writer that waits `delay_s` before every layer."""

    def __init__(self, inner: LayerWriter, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def write_layer(self, layer, k, v, start=0) -> None:
        time.sleep(self.delay_s)
        self.inner.write_layer(layer, k, v, start)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@dataclass(eq=False)
class PrefillItem:
    order: int
    msg: Prefill
    seq: Sequence
    writer: object
    sink: Responder
    chunked: bool  # longer than a pass: computed chunk by chunk against the local pool
    queued_at: float
    started_at: float = 0.0
    compute_s: float = 0.0
    aborted: bool = False
    cached_tokens: int = 0  # leading tokens taken from this worker's own prefix cache

    @property
    def pooled(self) -> bool:
        """Computed against pages of the local pool (so its K/V can be cached), not straight to its writer."""
        return bool(self.seq.page_table)

    @property
    def dest_start(self) -> int:
        """Positions before this are already in the destination (its own prefix cache)."""
        return self.msg.destination.start if self.msg.destination is not None else 0


def send_cached(cache: KVCache, it: PrefillItem) -> None:
    """Write the cached positions the destination lacks, [dest_start, seq.num_cached), from the local
    pool to the item's writer: the part of the prompt this worker did not compute but must still hand over.
    Both ends are page boundaries (cached runs are whole pages; a destination starts on one)."""
    start, end = it.dest_start, it.seq.num_cached
    if it.msg.destination is None or end <= start:
        return
    tpp = cache.layout.tokens_per_page
    pages = torch.tensor(it.seq.page_table[start // tpp:end // tpp], device=cache.device)  # [P]
    for layer in range(cache.layout.num_layers):
        k = cache.data[layer, 0].index_select(0, pages).flatten(0, 1)  # [P * tpp, kv_heads, head_dim]
        v = cache.data[layer, 1].index_select(0, pages).flatten(0, 1)
        it.writer.write_layer(layer, k, v, start)
