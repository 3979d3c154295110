"""The decode worker: owns a KV pool, leases its pages to requests, runs continuous batching.

It serves both halves of the house: a *decode* worker (pages written by a remote prefill worker,
or a short prompt prefilled here: conditional disaggregation) and a *co-located* worker (every
prompt prefilled here), which is the same worker with `pool=None` (no writers from outside).
A request's life is the Lease state machine of engine/workers/leases.py. In the pull handoff an Open
carries the PullSource of its prefilled K/V: the worker reserves pages, reads the K/V into them
(engine/workers/puller.py), answers Pulled, and the request decodes from the first token it carries.

Prefix cache (engine/prefix_cache.py): an Open takes the longest cached run of its prompt's pages; a
remote writer is told to start after them (Destination.start, Reserved.cached_tokens) and a local
prefill computes only the rest. Pages are named once their K/V are in: after each pass for what this
worker computed, and when the pages arrived for what a prefill worker wrote.

An answer's tokens leave through a Relay (engine/workers/relay.py): after Open.renew_after tokens on one
call it ends that call with a `renew` ticket and holds what follows until the orchestrator's Continue.

Threads: control calls (`open`, `resume`, `start`, `release`, `watch`, `writer_gone`) come from Triton's
threads and only touch bookkeeping under the lock: a reservation is answered at once, never after a
model pass. Everything else (state changes, the model, freeing pages) happens on the loop thread,
which sleeps on its inbox and a deadline heap (engine/workers/loop.py) when there is nothing to do;
that side is engine/workers/decode_loop.py.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Callable

from engine.engine import Engine
from engine.scheduler import Scheduler
from engine.transports.host import PoolHost
from engine.workers.cache_feed import CacheFeed
from engine.workers.decode_loop import DecodeLoop, Due
from engine.workers.leases import Lease, LeaseState
from engine.workers.loop import Deadlines, Loop
from engine.workers.puller import Puller
from engine.workers.relay import Relay
from engine.workers.sink import Responder
from engine.workers.watchers import Watchers
from tandem.call_renewal import WATCH_RENEW_AFTER, Continue, answer_tokens
from tandem.pool import host_identity
from tandem.roles import Role
from tandem.status import Cancelled, LeaseLost, OutOfPages, ProtocolError
from tandem.tracing import NOOP, Tracer
from tandem.wire import Ack, Open, Release, Reserved, Start, WorkerStats


class DecodeWorker(DecodeLoop):
    def __init__(self, engine: Engine, pool: PoolHost | None, *, role: Role = Role.DECODE, max_batch_size: int = 256,
                 pass_tokens: int = 512, chunk_tokens: int | None = 64, transfer_timeout_s: float = 30.0,
                 fence_timeout_s: float = 60.0, clock=time.monotonic, registry: dict | None = None,
                 tracer: Tracer = NOOP):
        """`pool` None: a co-located worker (every request prefilled here). `chunk_tokens` is the local
        prefill policy (None: prefill-first, see engine/scheduler.py). `registry`: inproc pools to pull from.
        `tracer`: where the spans of traced requests (Open.traceparent) go (decode_loop.py)."""
        self.engine, self.pool, self.role, self.tracer = engine, pool, role, tracer
        self.host = pool.host if pool is not None else host_identity()
        self.scheduler = Scheduler(engine, max_batch_size, pass_tokens, chunk_tokens)
        self.transfer_timeout_s, self.fence_timeout_s = transfer_timeout_s, fence_timeout_s
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.relays: dict[str, Relay] = {}  # by request id: its lease's sink, kept while parked after the lease ended
        self.fencing: dict[int, Lease] = {}  # by slot
        self.inbox: deque[Lease] = deque()  # leases whose state the loop must look at
        self.fenced_slots: deque[int] = deque()  # fence revocations finished by the fence thread
        self.gone_writers: deque[str] = deque()
        self.arrived: set[str] = set()  # "pages ready" notices for leases not yet started
        self.lock = threading.Lock()
        self.deadlines = Deadlines(clock)
        self.feed = CacheFeed(max(1024, 2 * engine.allocator.num_pages))
        self.watchers = Watchers(self.stats, clock, self.feed)
        self.kv_bytes_received = 0
        self.loop = Loop(self._iterate, self._next_due, f"{role}-loop", clock)
        self.puller = Puller(engine.cache, engine.kv_layout(), self.host, self.loop.wake, registry)

    def launch(self, on_crash: Callable[[BaseException], None] | None = None) -> "DecodeWorker":
        """Start the loop thread; `on_crash(error)` if it or the heartbeat thread ever dies of an exception
        (see loop.py)."""
        self.watchers.on_crash = on_crash
        self.loop.start(on_crash)
        return self

    # -- control calls (any thread) -----------------------------------------------------------------

    def open(self, msg: Open, sink: Responder) -> None:
        """Lease pages for a request (OutOfPages at once when they are not there). A remote prefill gets
        a Reserved reply naming them; a local one is queued for the loop."""
        if self.pool is None and not msg.local_prefill:
            raise ProtocolError("this co-located worker prefills every request itself: send local_prefill=true")
        seq = self.engine.new_sequence(msg.request_id, msg.prompt_ids, msg.sampling, msg.output_ids)
        sink = Relay(sink, answer_tokens(msg.renew_after), self.transfer_timeout_s, self.clock)
        if msg.source is not None and (msg.local_prefill or msg.source.tokens != seq.num_tokens):
            raise ProtocolError(f"request {msg.request_id!r}: a pull source must cover the prompt and the tokens "
                                f"already sent ({seq.num_tokens}), got {msg.source.tokens}, without local_prefill")
        with self.lock:
            if msg.request_id in self.leases:
                raise ProtocolError(f"request {msg.request_id!r} is already open here")
            try:
                cached = self.engine.prefix.reserve(seq, self.engine.cache.layout.pages_for(seq.budget))
            except OutOfPages:
                if msg.source is not None:  # refused before reading: the source need not wait for a read
                    self.puller.say_closed(msg.source)
                raise
            pages = seq.page_table
            lease = Lease(msg.request_id, secrets.token_hex(8), seq, pages, sink, LeaseState.PREFILLING,
                          cached_tokens=cached, source=msg.source, traceparent=msg.traceparent)
            if msg.source is not None:
                lease.state = LeaseState.PULLING
            elif not msg.local_prefill:
                try:
                    self._hand_out(lease, msg)
                except BaseException:
                    self.engine.allocator.free(pages)
                    raise
            self.leases[msg.request_id], self.relays[msg.request_id] = lease, sink
            self.inbox.append(lease)
        if lease.handed_out:  # the writer skips the cached pages: it never writes a shared page
            sink.send(Reserved(msg.request_id, lease.token, self.pool.destination(
                lease.transport, pages, lease.slot, lease.epoch, start=cached), cached_tokens=cached))
        self.loop.wake()

    def resume(self, msg: Continue, sink: Responder) -> None:
        """The rest of an answer whose call ended with a `renew` ticket, over this call's `sink`: what was
        held since first (LeaseLost when no answer here waits for that ticket)."""
        with self.lock:
            relay = self.relays.get(msg.request_id)
            if relay is None or not relay.resume(msg.ticket, sink):
                raise LeaseLost(f"request {msg.request_id!r}: no answer waits here for that ticket (it ended, its "
                                f"Continue came later than {self.transfer_timeout_s:.0f}s, or this worker restarted)")
            if relay.done:
                del self.relays[msg.request_id]

    def _hand_out(self, lease: Lease, msg: Open) -> None:
        lease.transport = self.pool.choose(msg.writer_host)
        lease.slot, lease.epoch = self.pool.lease_slot()
        lease.writer, lease.state = msg.writer, LeaseState.RESERVED
        lease.seq.num_cached = lease.seq.num_tokens  # the writer fills every position so far

    def start(self, msg: Start) -> Ack:
        """The first token arrived (the prefill finished writing): the request may decode."""
        with self.lock:
            lease = self._owned(msg.request_id, msg.lease)
            if lease.state is not LeaseState.RESERVED:
                raise ProtocolError(f"request {msg.request_id!r} is {lease.state.value}, not reserved")
            lease.seq.append(msg.token, msg.logprob)
            lease.writer_done = True  # the prefill replied only after its last write landed
            lease.pages_ready = lease.transport not in self.pool.notifies or msg.request_id in self.arrived
            self.arrived.discard(msg.request_id)
            lease.state = LeaseState.WAITING_KV
            if not lease.pages_ready:
                self.deadlines.after(self.transfer_timeout_s, (Due.TRANSFER, msg.request_id))
            self.inbox.append(lease)
        self.loop.wake()
        return Ack()

    def release(self, msg: Release) -> Ack:
        """End a request in whatever state it is; its Open request ends with CANCELLED."""
        with self.lock:
            lease = self.leases.get(msg.request_id)
            if lease is None:
                return Ack(found=False)  # already ended (finished, or released twice): nothing to do
            self._owned(msg.request_id, msg.lease)
            lease.writer_done = lease.writer_done or msg.writer_closed
            lease.end_status = lease.end_status or Cancelled(f"request {msg.request_id} was released")
            self.inbox.append(lease)
        self.loop.wake()
        return Ack()

    def writer_gone(self, writer: str) -> Ack:
        """A prefill worker is dead: no write of it can land any more (frees its fenced leases)."""
        with self.lock:
            self.gone_writers.append(writer)
        self.loop.wake()
        return Ack()

    def watch(self, sink: Responder, heartbeat_s: float, owner: str = "",
              renew_after: int = WATCH_RENEW_AFTER) -> None:
        self.watchers.add(sink, heartbeat_s, owner, renew_after)
        self.loop.wake()

    def _owned(self, request_id: str, token: str) -> Lease:
        lease = self.leases.get(request_id)
        if lease is None:
            raise LeaseLost(f"request {request_id!r} holds no pages here (it ended, or this worker restarted)")
        if lease.handed_out and not secrets.compare_digest(lease.token, token):
            raise ProtocolError(f"request {request_id!r}: its pages are leased to someone else (lease mismatch)")
        return lease

    def stats(self) -> WorkerStats:
        with self.lock:
            states = [lease.state for lease in self.leases.values()]
            a = self.engine.allocator
            self.feed.collect(a)
            c = a.counters()
            return WorkerStats(role=self.role, host=self.host, pages_total=a.num_pages, pages_used=a.num_used,
                               pages_cached=c.cached_pages, pages_fenced=sum(len(x.pages) for x in self.fencing.values()),
                               running=self.scheduler.size,
                               reserved=sum(states.count(s) for s in (LeaseState.RESERVED, LeaseState.PULLING,
                                                                      LeaseState.WAITING_KV)),
                               kv_bytes_received=self.kv_bytes_received, cache_hits=c.hit_pages,
                               cache_misses=c.miss_pages, cache_evictions=c.evicted_pages,
                               engine_salt=self.engine.salt.hex() if a.enabled else "",
                               lora_adapters=len(self.engine.model.loras))

    def flush(self) -> Ack:
        """Drop every idle cached page (pages of running requests keep their names); watchers hear of it."""
        with self.lock:
            self.engine.allocator.flush()
        self.watchers.push(force=True)
        return Ack()

    # -- the loop (one thread) ----------------------------------------------------------------------

    def close(self) -> None:
        self.loop.stop()
        self.puller.close()
        self.watchers.close()
