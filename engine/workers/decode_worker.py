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

Threads: control calls (`open`, `start`, `release`, `watch`, `writer_gone`) come from Triton's
threads and only touch bookkeeping under the lock: a reservation is answered at once, never after a
model pass. Everything else (state changes, the model, freeing pages) happens on the loop thread,
which sleeps on its inbox and a deadline heap (engine/workers/loop.py) when there is nothing to do.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Callable

from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.scheduler import Scheduler
from engine.transports.host import PoolHost
from engine.workers.cache_feed import CacheFeed
from engine.workers.leases import Lease, LeaseState
from engine.workers.loop import Deadlines, Loop
from engine.workers.puller import Puller
from engine.workers.sink import Responder
from engine.workers.watchers import Watchers
from tandem.pool import host_identity
from tandem.status import Cancelled, DeadlineExceeded, LeaseLost, TandemError, TransferFailed
from tandem.wire import Ack, Open, Pulled, Release, Reserved, Start, Token, WorkerStats

# How often open requests are checked for a caller that vanished without a Release (an orchestrator that
# died: Triton marks its requests cancelled, but tells no one). Only while requests are open.
CANCEL_SWEEP_S = 1.0
SWEEP = ("sweep", "")
# While a NIXL writer may be writing: poll this often (UCX over TCP lands WRITEs only while we poll)
PROGRESS_S = 0.002
PROGRESS = ("progress", "")


class DecodeWorker:
    def __init__(self, engine: Engine, pool: PoolHost | None, *, role: str = "decode", max_batch_size: int = 256,
                 pass_tokens: int = 512, chunk_tokens: int | None = 64, transfer_timeout_s: float = 30.0,
                 fence_timeout_s: float = 60.0, clock=time.monotonic, registry: dict | None = None):
        """`pool` None: a co-located worker (every request prefilled here). `chunk_tokens` is the local
        prefill policy (None: prefill-first, see engine/scheduler.py). `registry`: inproc pools to pull from."""
        self.engine, self.pool, self.role = engine, pool, role
        self.host = pool.host if pool is not None else host_identity()
        self.scheduler = Scheduler(engine, max_batch_size, pass_tokens, chunk_tokens)
        self.transfer_timeout_s, self.fence_timeout_s = transfer_timeout_s, fence_timeout_s
        self.clock = clock
        self.leases: dict[str, Lease] = {}
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
        """Start the loop thread; `on_crash(error)` if it ever dies of an exception (see loop.py)."""
        self.loop.start(on_crash)
        return self

    # -- control calls (any thread) -----------------------------------------------------------------

    def open(self, msg: Open, sink: Responder) -> None:
        """Lease pages for a request (OutOfPages at once when they are not there). A remote prefill gets
        a Reserved reply naming them; a local one is queued for the loop."""
        if self.pool is None and not msg.local_prefill:
            raise InvalidRequest("this co-located worker prefills every request itself: send local_prefill=true")
        seq = self.engine.new_sequence(msg.request_id, msg.prompt_ids, msg.sampling, msg.output_ids)
        if msg.source is not None and (msg.local_prefill or msg.source.tokens != seq.num_tokens):
            raise InvalidRequest(f"request {msg.request_id!r}: a pull source must cover the prompt and the tokens "
                                 f"already sent ({seq.num_tokens}), got {msg.source.tokens}, without local_prefill")
        with self.lock:
            if msg.request_id in self.leases:
                raise InvalidRequest(f"request {msg.request_id!r} is already open here")
            cached = self.engine.prefix.reserve(seq, self.engine.cache.layout.pages_for(seq.budget))  # OutOfPages
            pages = seq.page_table
            lease = Lease(msg.request_id, secrets.token_hex(8), seq, pages, sink, LeaseState.PREFILLING,
                          cached_tokens=cached, source=msg.source)
            if msg.source is not None:
                lease.state = LeaseState.PULLING
            elif not msg.local_prefill:
                try:
                    self._hand_out(lease, msg)
                except BaseException:
                    self.engine.allocator.free(pages)
                    raise
            self.leases[msg.request_id] = lease
            self.inbox.append(lease)
        if lease.handed_out:  # the writer skips the cached pages: it never writes a shared page
            sink.send(Reserved(msg.request_id, lease.token, self.pool.destination(
                lease.transport, pages, lease.slot, lease.epoch, start=cached), cached_tokens=cached))
        self.loop.wake()

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
                raise InvalidRequest(f"request {msg.request_id!r} is {lease.state.value}, not reserved")
            lease.seq.append(msg.token, msg.logprob)
            lease.writer_done = True  # the prefill replied only after its last write landed
            lease.pages_ready = lease.transport not in self.pool.notifies or msg.request_id in self.arrived
            self.arrived.discard(msg.request_id)
            lease.state = LeaseState.WAITING_KV
            if not lease.pages_ready:
                self.deadlines.after(self.transfer_timeout_s, ("transfer", msg.request_id))
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

    def watch(self, sink: Responder, heartbeat_s: float) -> None:
        self.watchers.add(sink, heartbeat_s)
        self.loop.wake()

    def _owned(self, request_id: str, token: str) -> Lease:
        lease = self.leases.get(request_id)
        if lease is None:
            raise LeaseLost(f"request {request_id!r} holds no pages here (it ended, or this worker restarted)")
        if lease.handed_out and not secrets.compare_digest(lease.token, token):
            raise InvalidRequest(f"request {request_id!r}: its pages are leased to someone else (lease mismatch)")
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
                               cache_salt=self.engine.salt.hex() if a.enabled else "")

    def flush(self) -> Ack:
        """Drop every idle cached page (pages of running requests keep their names); watchers hear of it."""
        with self.lock:
            self.engine.allocator.flush()
        self.watchers.push(force=True)
        return Ack()

    # -- the loop (one thread) ----------------------------------------------------------------------

    def _iterate(self) -> bool:
        with self.lock:
            changed = self._housekeeping()
        ran = self.scheduler.has_work
        events = self.scheduler.step() if ran else []
        if ran:
            with self.lock:  # name what the pass computed before a finished request's pages are freed
                named = sum(self.engine.prefix.commit(s) for s in [*self.scheduler.waiting, *self.scheduler.running,
                                                                  *(ev.seq for ev in events)])
            if named:
                self.watchers.push(force=True)  # routers hear of the pages before the client hears the answer
            with self.lock:
                for ev in events:
                    self._deliver(self.leases.get(ev.seq.request_id), ev)
        self.watchers.push(force=changed or any(ev.seq.finished for ev in events))
        return bool(events) or self.scheduler.has_work

    def _deliver(self, lease: Lease | None, ev) -> None:
        if lease is None:
            return
        reason = ev.seq.finish_reason.value if ev.seq.finished else None
        cached = lease.cached_tokens if lease.state is LeaseState.PREFILLING else 0  # on its first token only
        first = lease.state is LeaseState.PREFILLING
        lease.state = LeaseState.RUNNING
        lease.sink.send(Token(ev.token, ev.logprob, reason, cached_tokens=cached, top=ev.seq.top_report,
                              prompt_logprobs=ev.seq.prompt_logprobs if first else []), final=reason is not None)
        if reason is not None:
            self._end(lease, None)

    def _housekeeping(self) -> bool:
        """Apply notices, fence completions, timeouts and calls; admit ready requests. True if anything changed."""
        changed = self._notices()
        for result in self.puller.collect():
            changed = True
            self._pulled(result)
        for key in self.deadlines.due():
            changed = changed or key != PROGRESS  # a progress tick changes nothing by itself
            self._deadline(key)
        while self.inbox:
            changed = True
            lease = self.inbox.popleft()
            if self.leases.get(lease.request_id) is lease:
                self._advance(lease)
        for lease in [x for x in self.leases.values() if x.state is LeaseState.WAITING_KV]:
            changed |= self._advance(lease)
        # Armed last, after the due ones fired: the loop may sleep right after this call, and a tick
        # that fired without re-arming would leave a lease nobody looks at again.
        if self.leases and not self.deadlines.armed(SWEEP):
            self.deadlines.after(CANCEL_SWEEP_S, SWEEP)
        if self._awaiting_writes() and not self.deadlines.armed(PROGRESS):
            self.deadlines.after(PROGRESS_S, PROGRESS)  # the next iteration polls the transport again
        return changed

    def _notices(self) -> bool:
        changed = False
        if self.pool is not None:
            notices = self.pool.poll()
            for rid in notices.ready:
                lease = self.leases.get(rid)
                if lease is not None and lease.state is LeaseState.WAITING_KV:
                    lease.pages_ready = True
                elif lease is not None:
                    self.arrived.add(rid)
            for slot, epoch in notices.closed:
                lease = self.fencing.get(slot)
                if lease is not None and lease.epoch == epoch:
                    self._fenced(slot)
                elif (lease := self._lease_in_slot(slot, epoch)) is not None:
                    lease.writer_done = True
            changed = bool(notices.ready or notices.closed)
        while self.fenced_slots:
            changed = True
            self._fenced(self.fenced_slots.popleft())
        while self.gone_writers:
            writer = self.gone_writers.popleft()
            for slot in [s for s, x in self.fencing.items() if x.writer == writer]:
                self._fenced(slot)
            changed = True
        return changed

    def _awaiting_writes(self) -> bool:
        """A lease whose writer is (or may soon be) writing through a transport that must be polled."""
        return self.pool is not None and any(
            x.transport and not x.pages_ready and self.pool.needs_progress(x.transport)
            for x in self.leases.values() if x.state in (LeaseState.RESERVED, LeaseState.WAITING_KV))

    def _lease_in_slot(self, slot: int, epoch: int) -> Lease | None:
        return next((x for x in self.leases.values() if x.slot == slot and x.epoch == epoch), None)

    def _advance(self, lease: Lease) -> bool:
        """Move one lease along its state machine; True if it moved."""
        if lease.end_status is None and lease.sink.cancelled():
            lease.end_status = Cancelled(f"request {lease.request_id}: the caller went away")
        if lease.end_status is not None:
            self._end(lease, lease.end_status)
            return True
        if lease.state is LeaseState.PULLING and not lease.scheduled:
            lease.scheduled = True
            self.puller.submit(lease)
            return True
        if lease.state is LeaseState.PREFILLING and not lease.scheduled:
            lease.scheduled = True
            self.scheduler.add_prefill(lease.seq)
            return True
        if lease.state is LeaseState.WAITING_KV and lease.pages_ready and self.scheduler.has_room:
            self.deadlines.cancel(("transfer", lease.request_id))
            lease.state, lease.scheduled = LeaseState.RUNNING, True
            self.scheduler.add_running(lease.seq)
            self.engine.prefix.commit(lease.seq)  # the writer is done and every page arrived: name them
            written = lease.seq.num_cached - lease.cached_tokens
            self.kv_bytes_received += written * self.engine.cache.layout.bytes_per_token
            return True
        return False

    def _pulled(self, r) -> None:
        """A read returned: the lease decodes from its first token, or ends (pages freed now if it ended
        while the read was in flight)."""
        lease = r.lease
        lease.pulling = False
        if self.leases.get(lease.request_id) is not lease:
            self._free(lease)  # it ended during the read; its pages waited for the read to return
            return
        if r.error is not None:
            self._end(lease, r.error)
            return
        seq, src = lease.seq, lease.source
        seq.num_cached = seq.num_tokens
        seq.append(src.first_token, src.first_logprob)
        lease.state, lease.scheduled, lease.pages_ready = LeaseState.WAITING_KV, False, True
        lease.sink.send(Pulled(lease.request_id, r.kv_bytes, r.seconds, cached_tokens=lease.cached_tokens))
        self.inbox.append(lease)

    def _deadline(self, key) -> None:
        kind, rid = key
        if kind == "transfer":
            lease = self.leases.get(rid)
            if lease is not None and lease.state is LeaseState.WAITING_KV:
                self._end(lease, TransferFailed(f"request {rid}: KV pages never arrived within "
                                                f"{self.transfer_timeout_s:.0f}s; pages freed"))
        elif kind == "fence":
            lease = self.fencing.get(rid)
            if lease is not None:
                self._fenced(rid)  # the documented limit of a non-strict fence: see leases.py
        elif kind == "progress":
            pass  # nothing to do: being awake made housekeeping poll the transport
        elif kind == "sweep":
            for lease in list(self.leases.values()):
                if lease.sink.cancelled():
                    lease.end_status = Cancelled(f"request {lease.request_id}: the caller went away")
                    self.inbox.append(lease)

    def _end(self, lease: Lease, error: TandemError | None) -> None:
        """Take the lease out of service and answer its Open request; free its pages unless a writer may
        still write them (then they wait in `fencing`)."""
        self.leases.pop(lease.request_id, None)
        self.deadlines.cancel(("transfer", lease.request_id))
        self.scheduler.remove(lease.seq)
        if error is not None and not lease.sink.done:
            lease.sink.fail(error)
        if lease.pulling:
            lease.end_status = lease.end_status or error or Cancelled(f"request {lease.request_id} ended")
            return  # a read is copying into its pages: they are freed when it returns (_pulled)
        if not lease.handed_out:
            self._free(lease)
            return
        if lease.needs_fence() and not self.pool.strict(lease.transport):
            self._quarantine(lease)  # NIXL: wait for the writer's close notice
        elif self.pool.revoke(lease.slot, self._on_fenced):
            self._free(lease)
            self.pool.free_slot(lease.slot)
        else:
            self._quarantine(lease)  # a copy is in flight: the fence thread reports when it is out

    def _quarantine(self, lease: Lease) -> None:
        lease.state = LeaseState.FENCING
        self.fencing[lease.slot] = lease
        if not self.pool.strict(lease.transport):
            self.deadlines.after(self.fence_timeout_s, ("fence", lease.slot))

    def _on_fenced(self, slot: int) -> None:  # the fence thread
        with self.lock:
            self.fenced_slots.append(slot)
        self.loop.wake()

    def _fenced(self, slot: int) -> None:
        lease = self.fencing.pop(slot, None)
        if lease is None:
            return
        self.deadlines.cancel(("fence", slot))
        if self.pool.strict(lease.transport) or self.pool.revoke(slot, self._on_fenced):
            self._free(lease)
            self.pool.free_slot(slot)
        else:
            self.fencing[slot] = lease

    def _free(self, lease: Lease) -> None:
        if lease.pages:
            self.engine.allocator.free(lease.pages)
            lease.pages, lease.seq.page_table = [], []

    def _next_due(self) -> float | None:
        with self.lock:
            return self.deadlines.next()

    def close(self) -> None:
        self.loop.stop()
        self.puller.close()
        self.watchers.close()
