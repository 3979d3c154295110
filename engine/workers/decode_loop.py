"""The decode worker's loop side (engine/workers/decode_worker.py holds its calls): every state change,
the model passes, the deadlines (a sweep for callers that vanished, transport progress, writers that
stall, fences) and freeing pages happen here, on the loop thread."""

from __future__ import annotations

import enum
import time

from engine.workers.leases import Lease, LeaseState
from policies.prefill_passes import in_turn
from tandem.status import Cancelled, TandemError, TransferFailed, status_of
from tandem.tracing import ns_at
from tandem.wire import Pulled, Token

# How often open requests are checked for a caller that vanished without a Release (an orchestrator that
# died: Triton marks its requests cancelled, but tells no one). Only while requests are open.
CANCEL_SWEEP_S = 1.0
# While a NIXL writer may be writing: poll this often (UCX over TCP lands WRITEs only while we poll)
PROGRESS_S = 0.002
# While only a fenced lease waits for its NIXL writer's close notice (an idle worker polls for nothing else)
FENCE_POLL_S = 0.05


class Due(enum.Enum):
    """What a deadline of the decode loop is for. Its key in `deadlines` is (Due, target); ON_DUE below
    says what firing does."""

    TRANSFER = "transfer"  # target: a request id whose K/V must arrive by then (its Start armed it)
    FENCE = "fence"  # target: a slot whose non-strict fence gives up waiting for the writer's close
    PROGRESS = "progress"  # target "": poll a transport that lands writes only while polled
    SWEEP = "sweep"  # target "": look for callers that went away without a Release


SWEEP = (Due.SWEEP, "")
PROGRESS = (Due.PROGRESS, "")


class DecodeLoop:
    """The loop-thread half of DecodeWorker (a mixin: it uses the worker's state)."""

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
            if self.leases.get(lease.request_id) is lease and lease.state is not LeaseState.WAITING_KV:
                self._advance(lease)
        # those whose K/V are in join the batch as it has room: the lowest priority value first, then in order
        for lease in in_turn([x for x in self.leases.values() if x.state is LeaseState.WAITING_KV], _priority):
            changed |= self._advance(lease)
        # Armed last, after the due ones fired: the loop may sleep right after this call, and a tick
        # that fired without re-arming would leave a lease nobody looks at again.
        if (self.leases or self.relays) and not self.deadlines.armed(SWEEP):
            self.deadlines.after(CANCEL_SWEEP_S, SWEEP)
        if (every := self._poll_every()) is not None and not self.deadlines.armed(PROGRESS):
            self.deadlines.after(every, PROGRESS)  # the next iteration polls the transport again
        return changed

    def _notices(self) -> bool:
        changed = False
        if self.pool is not None:
            notices = self.pool.poll()
            for rid in notices.ready:
                lease = self.leases.get(rid)
                if lease is not None and lease.state is LeaseState.WAITING_KV:
                    lease.pages_ready = True
                    self.deadlines.cancel((Due.TRANSFER, rid))  # arrived: it waits for room, not for pages
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

    def _poll_every(self) -> float | None:
        """How soon to poll the transport again: PROGRESS_S while a lease's writer is (or may soon be)
        writing through a transport that lands writes only while polled, FENCE_POLL_S while only a fenced
        lease's writer's close notice is awaited over one; None when nothing is."""
        if self.pool is None:
            return None
        if any(x.transport and not x.pages_ready and self.pool.needs_progress(x.transport)
               for x in self.leases.values() if x.state in (LeaseState.RESERVED, LeaseState.WAITING_KV)):
            return PROGRESS_S
        return FENCE_POLL_S if any(self.pool.needs_progress(x.transport) for x in self.fencing.values()) else None

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
            lease.scheduled, lease.decoding_since = True, time.perf_counter()
            self.scheduler.add_prefill(lease.seq)
            return True
        if lease.state is LeaseState.WAITING_KV and lease.pages_ready and self.scheduler.has_room:
            self.deadlines.cancel((Due.TRANSFER, lease.request_id))
            lease.state, lease.scheduled, lease.decoding_since = LeaseState.RUNNING, True, time.perf_counter()
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
        now = time.time_ns()
        self.tracer.record("tandem.kv_transfer", lease.traceparent, now - int(r.seconds * 1e9), now, direction="pull",
                           transport=src.transport, bytes=r.kv_bytes, cached_tokens=lease.cached_tokens)
        self.inbox.append(lease)

    def _deadline(self, key: tuple[Due, object]) -> None:
        kind, target = key
        ON_DUE[kind](self, target)

    def _transfer_overdue(self, rid: str) -> None:
        lease = self.leases.get(rid)
        if lease is not None and lease.state is LeaseState.WAITING_KV and not lease.pages_ready:
            self._end(lease, TransferFailed(f"request {rid}: KV pages never arrived within "
                                            f"{self.transfer_timeout_s:.0f}s; pages freed"))

    def _fence_overdue(self, slot: int) -> None:
        if self.fencing.get(slot) is not None:
            self._fenced(slot)  # the documented limit of a non-strict fence: see leases.py

    def _progress_tick(self, _: str) -> None:
        """Nothing to do: being awake made housekeeping poll the transport."""

    def _sweep(self, _: str) -> None:
        for lease in list(self.leases.values()):
            if lease.sink.cancelled():
                lease.end_status = Cancelled(f"request {lease.request_id}: the caller went away")
                self.inbox.append(lease)
        for rid in [rid for rid, r in self.relays.items() if rid not in self.leases and r.expired()]:
            del self.relays[rid]  # ended while parked, and no Continue came for what it holds

    def _end(self, lease: Lease, error: TandemError | None) -> None:
        """Take the lease out of service and answer its Open request; free its pages unless a writer may
        still write them (then they wait in `fencing`)."""
        self.leases.pop(lease.request_id, None)
        self.arrived.discard(lease.request_id)  # a writer's notice for a lease that never started
        self.deadlines.cancel((Due.TRANSFER, lease.request_id))
        self.scheduler.remove(lease.seq)
        self._traced(lease, error)
        if error is not None and not lease.sink.done:
            lease.sink.fail(error)
        if self.relays.get(lease.request_id) is lease.sink and not lease.sink.parked:
            del self.relays[lease.request_id]  # a parked one holds its last replies for the Continue
        never_read = lease.state is LeaseState.PULLING and not lease.scheduled
        if lease.pulling or never_read:
            lease.end_status = lease.end_status or error or Cancelled(f"request {lease.request_id} ended")
            if never_read:  # the read stops at once, reading nothing, and still tells the source it is
                # done (a NIXL hold's pages need not wait for the fence timeout): puller.py
                lease.scheduled = True
                self.puller.submit(lease)
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

    def _traced(self, lease: Lease, error: TandemError | None) -> None:
        """The request's `tandem.decode` span (under the orchestrator's attempt): from its hand-over to
        the scheduler (a local prefill included) to its end, with the tokens this attempt generated."""
        if lease.traceparent and lease.decoding_since:
            seq = lease.seq
            self.tracer.record("tandem.decode", lease.traceparent, ns_at(lease.decoding_since), time.time_ns(),
                               worker_role=self.role, local_prefill=not lease.handed_out and lease.source is None,
                               output_tokens=len(seq.output_ids),
                               finish_reason=seq.finish_reason.value if seq.finished else None,
                               status=status_of(error).value if error is not None else "OK")

    def _quarantine(self, lease: Lease) -> None:
        lease.state = LeaseState.FENCING
        self.fencing[lease.slot] = lease
        if not self.pool.strict(lease.transport):
            self.deadlines.after(self.fence_timeout_s, (Due.FENCE, lease.slot))

    def _on_fenced(self, slot: int) -> None:  # the fence thread
        with self.lock:
            self.fenced_slots.append(slot)
        self.loop.wake()

    def _fenced(self, slot: int) -> None:
        lease = self.fencing.pop(slot, None)
        if lease is None:
            return
        self.deadlines.cancel((Due.FENCE, slot))
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


ON_DUE = {Due.TRANSFER: DecodeLoop._transfer_overdue, Due.FENCE: DecodeLoop._fence_overdue,
          Due.PROGRESS: DecodeLoop._progress_tick, Due.SWEEP: DecodeLoop._sweep}  # every Due has one


def _priority(lease: Lease) -> int:
    return lease.seq.params.priority
