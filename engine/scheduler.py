"""Continuous batching over one engine: decode steps for running sequences, and local prefill.

Sequences arrive with their pages already reserved (the worker reserves them when a request opens,
so a full pool is an answer, not an unbounded queue in here), in one of two ways:
- `add_prefill(seq)`: the tokens after `seq.num_cached` (the prompt, or the part of it no cached
  prefix covers) are computed here: a co-located worker, or a decode worker prefilling a short suffix.
- `add_running(seq)`: K/V of everything but its newest token are in its pages (a remote prefill wrote
  them); the next decode step continues it.

Each `step()` is one forward pass, by one of two policies for local prefill (policies/batching.py):
- prefill-first (`chunk_tokens=None`): while prompts wait, one pass of the first of them that fit in
  `pass_tokens` (a longer prompt runs alone) and in the batch runs, and the decodes stall for it;
  otherwise one decode step of every running sequence.
- chunked (`chunk_tokens=N`): every pass decodes one token for each running sequence and adds up to N
  prompt tokens of the prompts the batch has room for (in turn), so a long prompt is spread over
  many passes.
"First" is arrival order, or with priorities the lowest priority value first (`add_prefill`).
The batch cap, `max_batch_size`, counts running sequences and prompts being prefilled here.
The scheduler frees nothing: the caller releases a finished sequence's pages.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.engine import Engine
from engine.sequence import Sequence
from policies.batching import admit, chunk_split, enqueue


@dataclass(frozen=True)
class TokenEvent:
    seq: Sequence
    token: int
    logprob: float | None


class Scheduler:
    def __init__(self, engine: Engine, max_batch_size: int = 64, pass_tokens: int = 8192,
                 chunk_tokens: int | None = None):
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 (or None for prefill-first), got {chunk_tokens}")
        if pass_tokens < 1 or max_batch_size < 1:
            raise ValueError("pass_tokens and max_batch_size must be >= 1")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.pass_tokens = pass_tokens
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Sequence] = deque()  # prompts (partly) to compute here, in turn (add_prefill)
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def size(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def has_room(self) -> bool:
        return self.size < self.max_batch_size

    def add_prefill(self, seq: Sequence) -> None:
        """Queue a prompt: behind every waiting one of its priority or a lower value (arrival order among
        equals; all equal, first come first served), ahead of those of a higher value."""
        enqueue(self.waiting, seq, _priority)

    def add_running(self, seq: Sequence) -> None:
        self.running.append(seq)

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence out wherever it is (cancelled or released). False if it is not here."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
                return True
        return False

    def step(self) -> list[TokenEvent]:
        """One pass; finished sequences leave the scheduler (their events say so)."""
        events = self._prefill_first() if self.chunk_tokens is None else self._mixed()
        for ev in events:
            if ev.seq.finished and ev.seq in self.running:
                self.running.remove(ev.seq)
        return events

    def _prefill_first(self) -> list[TokenEvent]:
        n = admit(self.waiting, self._todo, self.pass_tokens, self.max_batch_size - len(self.running))
        batch = [self.waiting.popleft() for _ in range(n)]
        if batch:
            return self._prefill(batch)
        return self._decode() if self.running else []

    def _todo(self, seq: Sequence) -> int:
        return seq.num_tokens - seq.num_cached

    def _prefill(self, batch: list[Sequence]) -> list[TokenEvent]:
        fresh = [s for s in batch if s.num_cached == 0]
        rest = [s for s in batch if s.num_cached > 0]  # a cached prefix: continue against its pages
        out = list(zip(fresh, self.engine.prefill(fresh))) if fresh else []
        if rest:
            out += list(zip(rest, self.engine.extend(rest, [self._todo(s) for s in rest])))
        self.running.extend(batch)
        return [TokenEvent(s, t, lp) for s, (t, lp) in out]

    def _decode(self) -> list[TokenEvent]:
        batch = list(self.running)
        return [TokenEvent(s, t, lp) for s, (t, lp) in zip(batch, self.engine.decode_step(batch))]

    def _mixed(self) -> list[TokenEvent]:
        admitted = list(self.waiting)[:max(0, self.max_batch_size - len(self.running))]
        chunks = chunk_split([self._todo(s) for s in admitted], self.chunk_tokens)
        seqs = list(self.running) + admitted[:len(chunks)]
        counts = [1] * len(self.running) + chunks
        if not seqs:
            return []
        events = []
        for seq, out in zip(seqs, self.engine.extend(seqs, counts)):
            if out is None:
                continue  # a prompt chunk with more to come
            if seq in self.waiting:
                self.waiting.remove(seq)
                self.running.append(seq)
            events.append(TokenEvent(seq, *out))
        return events


def _priority(seq: Sequence) -> int:
    return seq.params.priority
