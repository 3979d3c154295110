"""The prefill worker: prompts in, first tokens out, K/V written straight into a decode worker's pages.

A request is submitted (its writer opened into the destination pages) and queued. Each step of the
loop runs one pass of at most `pass_tokens` tokens, either
- a packed pass of whole prompts (the oldest first, then the shortest that fit), each layer's K/V
  going to the writers as it is computed, or
- the next chunk of one long prompt (longer than a pass), prefilled against a local KV pool and
  streamed to its destination chunk by chunk.
When both kinds wait, passes alternate: a short prompt never waits for a whole long prompt, and a
long prompt always advances. A request is answered as soon as its last pass is done; one that fails
(a destination that cannot be written, its lease revoked) fails alone. An aborted or cancelled request
leaves the queue at the next pass boundary (at once if it has not started), its writer stopped.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import torch

from engine.engine import Engine
from engine.errors import OutOfPages
from engine.sequence import Sequence
from engine.transports import KVSender, LayerWriter, sender
from engine.workers.loop import Loop
from engine.workers.sink import Responder
from engine.workers.watchers import Watchers
from tandem.pool import host_identity
from tandem.status import Cancelled, TandemError
from tandem.wire import Ack, Prefill, Prefilled, WorkerStats


class DiscardWriter:
    """No destination: compute the first token only (a benchmark baseline, or a probe)."""

    bytes_written = 0

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        return None

    def stop(self) -> None:
        return None

    def finish(self) -> None:
        return None

    def abort(self) -> None:
        return None


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
class _Item:
    order: int
    msg: Prefill
    seq: Sequence
    writer: object
    sink: Responder
    chunked: bool
    queued_at: float
    started_at: float = 0.0
    compute_s: float = 0.0
    aborted: bool = False


class PrefillWorker:
    def __init__(self, engine: Engine, pass_tokens: int = 8192, write_delay_s: float = 0.0,
                 registry: dict | None = None):
        """`engine.cache`, when there is one, holds long prompts between their chunks."""
        self.engine = engine
        self.pass_tokens = pass_tokens
        tpp = engine.cache.layout.tokens_per_page if engine.cache is not None else 1
        self.chunk_tokens = max(tpp, pass_tokens // tpp * tpp)  # chunks start on page boundaries
        self.write_delay_s = write_delay_s
        self.registry = registry  # inproc transport (tests)
        self.host = host_identity()
        self.senders: dict[str, KVSender] = {}
        self.layout = engine.kv_layout()
        self.queue: list[_Item] = []  # waiting for a pass
        self.active: dict[str, _Item] = {}  # every request not yet answered (queued or in a pass), by id
        self.lock = threading.Lock()
        self._order = itertools.count()
        self._long_turn = False
        self.watchers = Watchers(self.stats)
        self.loop = Loop(self.step, self._progress_due, "prefill-loop")

    def launch(self) -> "PrefillWorker":
        self.loop.start()
        return self

    # -- calls (any thread) -------------------------------------------------------------------------

    def submit(self, msg: Prefill, sink: Responder) -> None:
        """Queue a request; raises (InvalidRequest, TransferFailed) at once for one that cannot run."""
        seq = self.engine.new_sequence(msg.request_id, msg.prompt_ids, msg.sampling, msg.output_ids)
        chunked = self.engine.cache is not None and seq.num_tokens > self.pass_tokens
        writer = self._writer(msg) if msg.destination is not None else DiscardWriter()
        item = _Item(next(self._order), msg, seq, writer, sink, chunked, time.perf_counter())
        with self.lock:
            self.queue.append(item)
            self.active[msg.request_id] = item
        self.loop.wake()

    def abort(self, request_id: str) -> Ack:
        """Stop a queued or running prefill; its request ends with CANCELLED. Its writer writes no more."""
        with self.lock:
            it = self.active.get(request_id)
            if it is not None:
                it.aborted = True
                it.writer.stop()  # the pass it may be in writes none of its layers from now on
        self.loop.wake()
        return Ack(found=it is not None)

    def watch(self, sink: Responder, heartbeat_s: float) -> None:
        self.watchers.add(sink, heartbeat_s)
        self.loop.wake()

    def stats(self) -> WorkerStats:
        with self.lock:
            queued = sum(it.seq.num_tokens - it.seq.num_cached for it in self.queue)
            return WorkerStats(role="prefill", host=self.host, running=len(self.queue), queued_tokens=queued)

    def _writer(self, msg: Prefill):
        dest = msg.destination
        if dest.transport not in self.senders:
            self.senders[dest.transport] = sender(dest.transport, self.layout, self.registry)
        w = self.senders[dest.transport].writer(dest, msg.request_id)
        return SlowWriter(w, self.write_delay_s) if self.write_delay_s > 0 else w

    # -- passes (the loop thread) -------------------------------------------------------------------

    def _progress_due(self) -> float | None:
        """When a transport next needs progressing (NIXL notices on their way out); None: never."""
        return min((t for t in (s.progress_due() for s in list(self.senders.values())) if t is not None),
                   default=None)

    def step(self) -> bool:
        """Run one pass if anything waits. True if a pass ran (or a request was dropped)."""
        for s in list(self.senders.values()):
            if s.progress_due() is not None:
                s.progress()
        with self.lock:
            dropped = self._drop_cancelled()
            longs = [it for it in self.queue if it.chunked]
            shorts = [it for it in self.queue if not it.chunked]
            take_long = bool(longs) and (self._long_turn or not shorts)
            group = [longs[0]] if take_long else self._pack(shorts) if shorts else []
            for it in group:
                self.queue.remove(it)
            self._long_turn = not take_long
        for it in dropped:
            self._end_cancelled(it)
        if group:
            self.watchers.push(force=True)
            self._chunk(group[0]) if take_long else self._packed(group)
        self.watchers.push(force=bool(group or dropped))
        return bool(group or dropped)

    def _drop_cancelled(self) -> list[_Item]:
        """Queued items that were aborted or whose caller went away (caller holds the lock)."""
        gone = [it for it in self.queue if it.aborted or it.sink.cancelled()]
        for it in gone:
            self.queue.remove(it)
            it.aborted = True
        return gone

    def _end_cancelled(self, it: _Item) -> None:
        it.writer.abort()
        self.engine.release(it.seq)  # a long prompt's local chunk pages
        self._done(it)
        it.sink.fail(Cancelled(f"prefill of {it.msg.request_id} was aborted"))

    def _done(self, it: _Item) -> None:
        with self.lock:
            if self.active.get(it.msg.request_id) is it:
                del self.active[it.msg.request_id]

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
        for it in group:
            it.started_at = it.started_at or t0
        try:
            outs = self.engine.prefill([it.seq for it in group], [it.writer for it in group])
        except Exception as e:  # a failed pass fails its requests, not the worker
            for it in group:
                it.writer.abort()
                self._done(it)
                it.sink.fail(e)
            return
        compute = time.perf_counter() - t0
        for it, out in zip(group, outs):
            it.compute_s = compute
            self._answer(it, out)

    def _chunk(self, it: _Item) -> None:
        seq, engine = it.seq, self.engine
        it.started_at = it.started_at or time.perf_counter()
        if not seq.page_table:
            try:
                seq.page_table = engine.allocator.allocate(engine.cache.layout.pages_for(seq.num_tokens))
            except OutOfPages as e:
                if any(x.chunked for x in self.queue):
                    with self.lock:
                        self.queue.append(it)  # others hold the pool; try again after them
                    return
                it.writer.abort()
                self._done(it)
                it.sink.fail(e)
                return
        n = min(self.chunk_tokens, seq.num_tokens - seq.num_cached)
        t0 = time.perf_counter()
        try:
            out = engine.extend([seq], [n], [it.writer])[0]
        except Exception as e:  # a failed chunk must not hold pages or leave the writer open
            engine.release(seq)
            it.writer.abort()
            self._done(it)
            it.sink.fail(e)
            return
        it.compute_s += time.perf_counter() - t0
        if out is None and not it.aborted:
            with self.lock:
                self.queue.insert(0, it)  # more chunks to go; keeps its place as the oldest long prompt
            return
        engine.release(seq)
        if it.aborted:
            self._end_cancelled(it)
        else:
            self._answer(it, out)

    def _answer(self, it: _Item, out) -> None:
        if it.aborted:
            self._end_cancelled(it)
            return
        token, logprob = out
        t1 = time.perf_counter()
        self._done(it)
        try:
            it.writer.finish()
        except TandemError as e:  # LeaseLost (the decode side took its pages back) or TransferFailed
            it.sink.fail(e)
            return
        reason = it.seq.finish_reason.value if it.seq.finish_reason else None
        it.sink.send(Prefilled(it.msg.request_id, token, logprob, reason, it.writer.bytes_written,
                               time.perf_counter() - t1, it.compute_s, it.started_at - it.queued_at), final=True)

    def close(self) -> None:
        self.loop.stop()
        self.watchers.close()
        for s in self.senders.values():
            s.close()
        self.senders.clear()
