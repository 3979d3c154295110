"""The prefill worker: prompts in, first tokens out, K/V handed straight to the decode worker's pages.

A request is submitted (validated; a transport writer opened into its destination pages) and
queued. Each `step` runs one pass of at most `pass_tokens` tokens, either
- a packed pass of whole prompts (the oldest first, then the shortest that fit), each layer's K/V
  going to the writers as it is computed, or
- the next chunk of one long prompt (longer than a pass), prefilled against a local KV pool and
  streamed to its destination chunk by chunk.
When both kinds wait, passes alternate: a short prompt never waits for a whole long prompt, and a
long prompt always advances. A request is answered as soon as its last pass is done; one that fails
(bad input, a destination that cannot be written) fails alone.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.engine import Engine
from engine.errors import EngineError, InvalidRequest, OutOfPages
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.transports import KVSender, TransferError, sender
from tandem.wire import PrefillRequest, PrefillResult

Result = PrefillResult | EngineError | TransferError


class DiscardWriter:
    """No destination: compute the first token only (a benchmark baseline, or a probe)."""

    bytes_written = 0

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        return None

    def finish(self) -> None:
        return None

    def abort(self) -> None:
        return None


@dataclass
class _Item:
    order: int
    req: PrefillRequest
    seq: Sequence
    writer: object
    on_result: Callable[[Result], None]
    chunked: bool
    compute_s: float = field(default=0.0)


class PrefillWorker:
    def __init__(self, engine: Engine, pass_tokens: int = 8192):
        """`engine.cache`, when there is one, holds long prompts between their chunks."""
        self.engine = engine
        self.pass_tokens = pass_tokens
        tpp = engine.cache.layout.tokens_per_page if engine.cache is not None else 1
        self.chunk_tokens = max(tpp, pass_tokens // tpp * tpp)  # chunks start on page boundaries
        self.senders: dict[str, KVSender] = {}
        self.layout = engine.kv_layout()
        self.queue: list[_Item] = []
        self.lock = threading.Lock()
        self.wakeup = threading.Event()
        self._order = itertools.count()
        self._long_turn = False

    # -- requests (any thread) ----------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], req: PrefillRequest, on_result: Callable[[Result], None]) -> None:
        """Queue a request; a bad one is answered (with its error) at once."""
        try:
            item = self._open(prompt_ids, req, on_result)
        except (EngineError, TransferError) as e:
            on_result(e)
            return
        with self.lock:
            self.queue.append(item)
        self.wakeup.set()

    def prefill_all(self, batch: list[tuple[list[int], PrefillRequest]]) -> list[Result]:
        """Submit every (prompt_ids, request) and run passes until all are answered, in order."""
        results: list = [None] * len(batch)
        for i, (ids, req) in enumerate(batch):
            self.submit(ids, req, lambda r, i=i: results.__setitem__(i, r))
        while self.step():
            pass
        return results

    def _open(self, prompt_ids: list[int], req: PrefillRequest, on_result) -> _Item:
        params = SamplingParams.from_dict(req.sampling)
        seq = self.engine.new_sequence(req.request_id, prompt_ids, params, req.output_ids)
        chunked = self.engine.cache is not None and seq.num_tokens > self.pass_tokens
        if req.destination is None:
            return _Item(next(self._order), req, seq, DiscardWriter(), on_result, chunked)
        dest = req.destination
        name = dest.pool.get("transport") if isinstance(dest.pool, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest("destination.pool has no 'transport' name")
        need = self.layout.pages_for(seq.num_tokens)
        if len(dest.page_ids) < need:
            raise InvalidRequest(f"destination has {len(dest.page_ids)} pages; {seq.num_tokens} tokens need {need}")
        writer = self._sender(name).writer(dest.pool, req.request_id, dest.page_ids)
        return _Item(next(self._order), req, seq, writer, on_result, chunked)

    def _sender(self, name: str) -> KVSender:
        if name not in self.senders:
            try:
                self.senders[name] = sender(name, self.layout)
            except ValueError as e:
                raise TransferError(str(e)) from None
        return self.senders[name]

    # -- passes (the loop thread) -------------------------------------------------------------------

    def step(self) -> bool:
        """Run one pass if anything waits. True if a pass ran."""
        with self.lock:
            longs = [it for it in self.queue if it.chunked]
            shorts = [it for it in self.queue if not it.chunked]
            if not longs and not shorts:
                return False
            take_long = bool(longs) and (self._long_turn or not shorts)
            group = [longs[0]] if take_long else self._pack(shorts)
            for it in group:
                self.queue.remove(it)
            self._long_turn = not take_long
        if take_long:
            self._chunk(group[0])
        else:
            self._packed(group)
        return True

    def _pack(self, shorts: list[_Item]) -> list[_Item]:
        """The oldest waiting prompt, then the shortest others that fit the pass."""
        group, tokens = [shorts[0]], shorts[0].seq.num_tokens
        for it in sorted(shorts[1:], key=lambda it: it.seq.num_tokens):
            if tokens + it.seq.num_tokens <= self.pass_tokens:
                group.append(it)
                tokens += it.seq.num_tokens
        return group

    def _packed(self, group: list[_Item]) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.engine.prefill([it.seq for it in group], [it.writer for it in group])
        except Exception:  # a failed pass must not leave writers half open
            for it in group:
                it.writer.abort()
            raise
        compute = time.perf_counter() - t0
        for it, out in zip(group, outs):
            it.compute_s = compute
            self._answer(it, out)

    def _chunk(self, it: _Item) -> None:
        seq, engine = it.seq, self.engine
        if not seq.page_table:
            try:
                seq.page_table = engine.allocator.allocate(engine.cache.layout.pages_for(seq.num_tokens))
            except OutOfPages as e:
                if any(x.chunked for x in self.queue):
                    with self.lock:
                        self.queue.append(it)  # others hold the pool; try again after them
                    return
                it.writer.abort()
                it.on_result(e)
                return
        n = min(self.chunk_tokens, seq.num_tokens - seq.num_cached)
        t0 = time.perf_counter()
        try:
            out = engine.extend([seq], [n], [it.writer])[0]
        except Exception:  # a failed chunk must not hold pages or leave the writer open
            engine.release(seq)
            it.writer.abort()
            raise
        it.compute_s += time.perf_counter() - t0
        if out is None:
            with self.lock:
                self.queue.insert(0, it)  # more chunks to go; keeps its place as the oldest long prompt
            return
        engine.release(seq)
        self._answer(it, out)

    def _answer(self, it: _Item, out) -> None:
        token, logprob = out
        t1 = time.perf_counter()
        try:
            it.writer.finish()
        except TransferError as e:
            it.on_result(e)
            return
        reason = it.seq.finish_reason.value if it.seq.finish_reason else None
        it.on_result(PrefillResult(it.req.request_id, token, logprob, reason, it.writer.bytes_written,
                                   time.perf_counter() - t1, it.compute_s))

    def run(self, stop: threading.Event) -> None:
        """The loop thread's body."""
        while not stop.is_set():
            if not self.step():
                self.wakeup.wait(0.1)
                self.wakeup.clear()

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        self.senders.clear()
