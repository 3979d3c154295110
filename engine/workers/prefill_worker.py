"""The prefill worker: prompts in, first tokens out, K/V written straight into a decode worker's pages.

A request is submitted (its writer opened into the destination pages) and queued. Each step of the
loop runs one pass of at most `pass_tokens` tokens (the rules: policies/prefill_passes.py), either
- a packed pass of whole prompts (the oldest first, then the shortest that fit; with priorities, the
  lowest priority value first), each layer's K/V
  going to the writers as it is computed, or
- the next chunk of one long prompt (longer than a pass), prefilled against a local KV pool and
  streamed to its destination chunk by chunk.
When both kinds wait, passes alternate: a short prompt never waits for a whole long prompt, and a
long prompt always advances.

With the prefix cache on, every prompt is computed against pages of the local pool (engine.extend over
its uncached suffix), so its full pages stay cached for the next prompt with the same prefix: only the
uncached part is computed, and the destination gets only what it lacks (positions from its `start`,
some of them sent from this worker's cache: prefill_items.send_cached). A prompt that finds no room in
the pool is computed straight into its writer, as with the cache off.

Pull handoff (`Prefill.pull`, control/handoff.py): the prompt is computed into pages of this worker's
own pool, exported like a decode pool (`pool`: shared memory and a fence table), and kept there under
a hold (engine/workers/holds.py) after the answer, which carries a PullSource for the decode worker
to read them from; the call stays open until the hold ends.

A request is answered as soon as its last pass is done; one that fails (a destination that cannot be
written, its lease revoked) fails alone. An aborted or cancelled request leaves the queue at the next
pass boundary (at once if it has not started), its writer stopped. The passes themselves are
engine/workers/prefill_runs.py. The pool's allocator is touched
only under `lock` (the loop thread, stats and Flush from Triton's threads).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

from engine.engine import Engine
from engine.errors import OutOfPages
from engine.transports import KVSender, sender
from engine.transports.base import DiscardWriter
from engine.transports.host import PoolHost
from engine.workers.cache_feed import CacheFeed
from engine.workers.holds import Holds
from engine.workers.loop import Loop
from engine.workers.prefill_items import PrefillItem, SlowWriter
from engine.workers.prefill_runs import PrefillRuns
from engine.workers.sink import Responder
from engine.workers.watchers import Watchers
from policies.prefill_passes import PassTurn, chunk_tokens, in_turn, next_long, pack
from tandem.call_renewal import WATCH_RENEW_AFTER
from tandem.pool import host_identity
from tandem.roles import Role
from tandem.status import Cancelled, ProtocolError
from tandem.tracing import NOOP, Tracer
from tandem.wire import Ack, Prefill, WorkerStats


class PrefillWorker(PrefillRuns):
    def __init__(self, engine: Engine, pass_tokens: int = 8192, write_delay_s: float = 0.0,
                 registry: dict | None = None, pool: PoolHost | None = None, tracer: Tracer = NOOP,
                 fence_timeout_s: float = 60.0):
        """`engine.cache`, when there is one, holds long prompts between their chunks and the prefix cache.
        `pool`: that cache exported to readers (pull handoff); None: this worker only pushes. `tracer`:
        where the spans of traced requests (Prefill.traceparent) go (prefill_runs.py). `fence_timeout_s`:
        how long an ended NIXL hold waits for its reader's notice (holds.py)."""
        self.engine, self.tracer = engine, tracer
        self.pass_tokens = pass_tokens
        tpp = engine.cache.layout.tokens_per_page if engine.cache is not None else 1
        self.chunk_tokens = chunk_tokens(pass_tokens, tpp)
        self.caching = engine.prefix is not None and engine.prefix.enabled
        self.write_delay_s = write_delay_s
        self.registry = registry  # inproc transport (tests)
        self.host = host_identity()
        self.senders: dict[str, KVSender] = {}
        self.layout = engine.kv_layout()
        self.queue: list[PrefillItem] = []  # waiting for a pass
        self.active: dict[str, PrefillItem] = {}  # every request not yet answered (queued or in a pass), by id
        self.lock = threading.Lock()
        self._order = itertools.count()
        self.turn = PassTurn()
        self.feed = CacheFeed(max(1024, 2 * engine.allocator.num_pages)) if self.caching else None
        self.watchers = Watchers(self.stats, feed=self.feed)
        self.holds = Holds(pool, lambda it: self._release(it, computed=True), fence_timeout_s) \
            if pool is not None else None
        self.loop = Loop(self.step, self._progress_due, "prefill-loop")

    def launch(self, on_crash: Callable[[BaseException], None] | None = None) -> "PrefillWorker":
        """Start the loop thread; `on_crash(error)` if it or the heartbeat thread ever dies of an exception
        (see loop.py)."""
        self.watchers.on_crash = on_crash
        self.loop.start(on_crash)
        return self

    # -- calls (any thread) -------------------------------------------------------------------------

    def submit(self, msg: Prefill, sink: Responder) -> None:
        """Queue a request; raises (InvalidRequest, ProtocolError, TransferFailed) at once for one that cannot
        run. A refused request's writer is opened and closed at once, so that its destination hears that no
        write will come (NIXL's `closed` notice: the decode lease need not wait for the fence timeout if the
        orchestrator cannot say `writer_closed`, its client having left before this answer)."""
        writer = self._writer(msg) if msg.destination is not None else DiscardWriter()
        try:
            if msg.pull and (self.holds is None or msg.destination is not None):
                raise ProtocolError("a pull prefill needs a worker that exports its pool (handoff mode pull) and "
                                    "takes no destination" if self.holds is None else
                                    "a pull prefill takes no destination")
            seq = self.engine.new_sequence(msg.request_id, msg.prompt_ids, msg.sampling, msg.output_ids)
        except BaseException:
            writer.abort()
            self.loop.wake()  # the notice leaves while the loop progresses the transport
            raise
        with self.lock:
            cached = self.engine.prefix.peek(seq) if self.caching else 0  # what it will likely find
            chunked = self.engine.cache is not None and seq.num_tokens - cached > self.pass_tokens
            item = PrefillItem(next(self._order), msg, seq, writer, sink, chunked, time.perf_counter(),
                               cached_tokens=cached)
            self.queue.append(item)
            self.active[msg.request_id] = item
        self.loop.wake()

    def abort(self, request_id: str) -> Ack:
        """Stop a queued or running prefill, or end its hold; it ends with CANCELLED. Its writer writes no more.
        The orchestrator aborts a pull prefill only while it has not seen its answer (PullAttempt), so no
        reader was handed the source: the hold's pages need not wait for one (holds.py)."""
        with self.lock:
            it = self.active.get(request_id)
            if it is not None:
                it.aborted = True
                it.writer.stop()  # the pass it may be in writes none of its layers from now on
        held = self.holds is not None and self.holds.end(request_id, error=Cancelled(f"{request_id} was aborted"),
                                                         reader_closed=True)  # sent before its source was seen
        self.loop.wake()
        return Ack(found=it is not None or held)

    def unhold(self, request_id: str, hold: str, reader_closed: bool = False) -> Ack:
        """The reader has the K/V (or never will): end the hold; its pages return once no read is in flight
        (`reader_closed`: the orchestrator knows none is, see holds.py)."""
        return Ack(found=self.holds is not None and self.holds.end(request_id, hold, reader_closed=reader_closed))

    def reader_gone(self, reader: str) -> Ack:
        """Decode worker `reader` is dead: holds waiting for its NIXL reads to end are over (holds.py)."""
        if self.holds is not None:
            self.holds.reader_gone(reader)
        self.loop.wake()
        return Ack()

    def watch(self, sink: Responder, heartbeat_s: float, owner: str = "",
              renew_after: int = WATCH_RENEW_AFTER) -> None:
        self.watchers.add(sink, heartbeat_s, owner, renew_after)
        self.loop.wake()

    def stats(self) -> WorkerStats:
        with self.lock:
            queued = sum(self._todo(it) for it in self.queue)
            a = self.engine.allocator
            loras = len(self.engine.model.loras)
            if a is None:
                return WorkerStats(role=Role.PREFILL, host=self.host, running=len(self.queue), queued_tokens=queued,
                                   lora_adapters=loras)
            if self.feed is not None:
                self.feed.collect(a)
            c = a.counters()
            return WorkerStats(role=Role.PREFILL, host=self.host, running=len(self.queue), queued_tokens=queued,
                               pages_total=a.num_pages, pages_used=a.num_used, pages_cached=c.cached_pages,
                               cache_hits=c.hit_pages, cache_misses=c.miss_pages, cache_evictions=c.evicted_pages,
                               engine_salt=self.engine.salt.hex() if self.caching else "",
                               pages_held=self.holds.pages() if self.holds is not None else 0, lora_adapters=loras)

    def flush(self) -> Ack:
        """Drop every idle cached page of the local pool (pages in a pass keep their names)."""
        if self.engine.allocator is not None:
            with self.lock:
                self.engine.allocator.flush()
        self.watchers.push(force=True)
        return Ack()

    def _writer(self, msg: Prefill):
        dest = msg.destination
        if dest.transport not in self.senders:
            self.senders[dest.transport] = sender(dest.transport, self.layout, self.registry, str(self.engine.device))
        w = self.senders[dest.transport].writer(dest, msg.request_id)
        return SlowWriter(w, self.write_delay_s) if self.write_delay_s > 0 else w

    # -- passes (the loop thread) -------------------------------------------------------------------

    def _progress_due(self) -> float | None:
        """When a transport next needs progressing (NIXL notices on their way out), or the holds' callers
        checking; None: never."""
        due = [s.progress_due() for s in list(self.senders.values())]
        due.append(self.holds.sweep_due() if self.holds is not None else None)
        return min((t for t in due if t is not None), default=None)

    def step(self) -> bool:
        """Run one pass if anything waits. True if a pass ran (or a request was dropped)."""
        for s in list(self.senders.values()):
            if s.progress_due() is not None:
                s.progress()
        swept = self.holds is not None and self.holds.sweep()
        full = []
        with self.lock:
            dropped = self._drop_cancelled()
            longs = [it for it in self.queue if it.chunked]
            shorts = [it for it in in_turn(self.queue, _priority) if not it.chunked]
            take_long = self.turn.take_long(bool(longs), bool(shorts))
            group = ([next_long(longs, _priority, _started)] if take_long else
                     pack(shorts, self._todo, self.pass_tokens, _priority) if shorts else [])
            for it in group:
                self.queue.remove(it)
                if (self.caching or it.msg.pull) and not take_long:
                    if (err := self._reserve(it)) is not None and it.msg.pull:
                        full.append((it, err))  # a pull prompt lives in the pool: no room, no pass
            group = [it for it in group if it not in {x for x, _ in full}]
        for it in dropped:
            self._end_cancelled(it)
        for it, err in full:
            self._fail(it, err)
        if group:
            self.watchers.push(force=True)
            self._chunk(group[0]) if take_long else self._packed(group)
        self.watchers.push(force=bool(group or dropped or full or swept))
        return bool(group or dropped or full)

    def _todo(self, it: PrefillItem) -> int:
        """Tokens still to compute: all but the cached prefix (or what a peek expects to find)."""
        return it.seq.num_tokens - max(it.seq.num_cached, it.cached_tokens)

    def _reserve(self, it: PrefillItem) -> OutOfPages | None:
        """Pages in the local pool, the cached prefix first (caller holds the lock); the error if no room."""
        seq = it.seq
        pages = self.engine.cache.layout.pages_for(seq.num_tokens)
        try:
            if self.caching:
                it.cached_tokens = self.engine.prefix.reserve(seq, pages)
            else:
                seq.page_table = self.engine.allocator.allocate(pages)
        except OutOfPages as e:
            it.cached_tokens = 0  # computed straight into its writer, or waiting for room
            return e
        return None

    def _release(self, it: PrefillItem, computed: bool) -> None:
        """Give the item's local pages back; `computed`: their K/V are complete, so cache them first."""
        with self.lock:
            if computed and self.caching:
                self.engine.prefix.commit(it.seq)
            self.engine.release(it.seq)

    def _drop_cancelled(self) -> list[PrefillItem]:
        """Queued items that were aborted or whose caller went away (caller holds the lock)."""
        gone = [it for it in self.queue if it.aborted or it.sink.cancelled()]
        for it in gone:
            self.queue.remove(it)
            it.aborted = True
        return gone

    def _end_cancelled(self, it: PrefillItem) -> None:
        it.writer.abort()
        self._release(it, computed=False)
        self._done(it)
        it.sink.fail(Cancelled(f"prefill of {it.msg.request_id} was aborted"))

    def _fail(self, it: PrefillItem, e: BaseException) -> None:
        """A failed pass or chunk: no pages held, no writer left open; the request fails alone."""
        self._release(it, computed=False)
        it.writer.abort()
        self._done(it)
        it.sink.fail(e)

    def _done(self, it: PrefillItem) -> None:
        with self.lock:
            if self.active.get(it.msg.request_id) is it:
                del self.active[it.msg.request_id]

    def close(self) -> None:
        self.loop.stop()
        if self.holds is not None:
            self.holds.close()
        self.watchers.close()
        for s in self.senders.values():
            s.close()
        self.senders.clear()


def _priority(it: PrefillItem) -> int:
    return it.msg.sampling.priority


def _started(it: PrefillItem) -> bool:
    """A long prompt part way through: its first chunks' pages are held."""
    return bool(it.seq.page_table)
