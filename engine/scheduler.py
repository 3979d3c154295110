"""Continuous batching inside one engine: `tandem generate` and the co-located baselines.

A request waits until its whole page budget fits, then runs until it finishes, then its pages go
back. Each `step()` is one forward pass:
- co-located (`chunk_tokens=None`): while prompts wait and fit, a packed prefill of as many as fit in
  `max_num_tokens` (a longer prompt alone) runs first (the running decodes stall for it); otherwise
  one decode step.
- chunked (`chunk_tokens=N`): every pass decodes one token for each running request and adds up to
  N prompt tokens of admitted prompts, so a long prompt is spread over many passes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sequence import Sequence


@dataclass(frozen=True)
class TokenEvent:
    seq: Sequence
    token: int
    logprob: float | None


class Scheduler:
    def __init__(self, engine: Engine, max_batch_size: int = 64, max_num_tokens: int = 8192,
                 chunk_tokens: int | None = None):
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt partly cached (chunked mode)
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, seq: Sequence) -> None:
        pages = self.engine.cache.layout.pages_for(seq.budget)
        if pages > self.engine.allocator.num_pages:
            raise InvalidRequest(f"request needs {pages} KV pages but the whole pool has "
                                 f"{self.engine.allocator.num_pages}; lower max_tokens or the prompt")
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its pages. False if it is not here."""
        for queue in (self.waiting, self.prefilling, self.running):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.engine.abort(seq)
                    return True
        return False

    def step(self) -> list[TokenEvent]:
        if self.chunk_tokens is None:
            batch = self._admit(self.max_num_tokens)
            events = self._prefill(batch) if batch else self._decode()
        else:
            events = self._mixed()
        for ev in events:
            if ev.seq.finished:
                self.running.remove(ev.seq)
                self.engine.release(ev.seq)
        return events

    def _admit(self, token_budget: int) -> list[Sequence]:
        """Move waiting requests whose pages fit into a batch, within the token and batch limits."""
        batch, tokens = [], 0
        room = self.max_batch_size - len(self.running) - len(self.prefilling)
        while self.waiting and len(batch) < room:
            seq = self.waiting[0]
            n = len(seq.prompt_ids)
            if (batch and tokens + n > token_budget) or not self.engine.can_admit(seq):
                break
            self.waiting.popleft()
            self.engine.admit(seq)
            batch.append(seq)
            tokens += n
        return batch

    def _prefill(self, batch: list[Sequence]) -> list[TokenEvent]:
        outs = self.engine.prefill(batch)
        self.running.extend(batch)
        return [TokenEvent(s, t, lp) for s, (t, lp) in zip(batch, outs)]

    def _decode(self) -> list[TokenEvent]:
        if not self.running:
            return []
        batch = list(self.running)
        return [TokenEvent(s, t, lp) for s, (t, lp) in zip(batch, self.engine.decode_step(batch))]

    def _mixed(self) -> list[TokenEvent]:
        self.prefilling.extend(self._admit(token_budget=1 << 30))
        seqs, counts = list(self.running), [1] * len(self.running)
        budget = self.chunk_tokens
        for seq in self.prefilling:
            if budget == 0:
                break
            n = min(budget, len(seq.prompt_ids) - seq.num_cached)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        if not seqs:
            return []
        events = []
        for seq, out in zip(seqs, self.engine.extend(seqs, counts)):
            if out is None:
                continue
            if seq in self.prefilling:
                self.prefilling.remove(seq)
                self.running.append(seq)
            events.append(TokenEvent(seq, *out))
        return events
