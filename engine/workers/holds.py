"""The pull handoff's hold on a prefill worker: a prefilled request's K/V kept in this worker's own
pool until its reader (a decode worker) has them. The mirror of a decode worker's lease (leases.py).

    Prefill(pull) ──last pass done──▶ HELD ──Unhold / Abort / caller gone──▶ REVOKING ──▶ freed
                                                                   (no read in flight: freed at once)

A hold lives exactly as long as its request, and no timer ends it. It ends when the orchestrator says
its reader is done (Unhold, sent once the decode worker answered Pulled) or that the request is over
(Abort: a cancel, a decode failure, a failover that prefills the request again elsewhere), or when the
caller of the Prefill call is gone (an orchestrator that died: Triton marks the call cancelled; a
sweep finds it). If this worker dies its pool dies with it, and nothing is left to hold.

The fence works the other way round from push: a held page is reused only when no reader can still
read it. Ending a hold revokes its slot in this pool's fence table first (engine/transports/fence.py).
- shm, cuda_ipc, inproc readers check their epoch under the slot's read lock around every layer they
  copy, so after the revoke no read can start, and the pages are freed only once the revoke held the
  write lock (a read in flight, even of a reader stopped mid-copy, keeps them out of use until it ends
  or its process dies);
- a NIXL reader READs the slot's epoch before its one-sided page READ, which this side cannot check
  (engine/transports/pull_nixl.py). So the pages of a NIXL hold are also kept out of use (REVOKING)
  until no reader can still read them: the hold was ended with `reader_closed` (the orchestrator's
  Unhold after Pulled: the read ended before Pulled was sent; or nobody was ever handed the source:
  an Abort, which the orchestrator sends only before it saw the source, or an Unhold saying so),
  or the reader's `closed` notice arrived (sent once its READs ended, and for an Open its decode worker
  refused or ended before any READ: engine/workers/puller.py), or its decode worker is known
  dead (ReaderGone, from `tandem serve`'s supervisor), or `fence_timeout_s` passed without any of
  these: a reader neither heard from nor done by then is presumed gone, the one bounded assumption
  (push's NIXL writers make the same one, control/handoff.py).
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.transports.host import PoolHost
from tandem.pool import PullSource
from tandem.status import ProtocolError
from tandem.wire import Ack

SWEEP_S = 1.0  # while holds exist: how often their callers are checked (a vanished orchestrator)
POLL_S = 0.002  # while NIXL holds exist: how often the pool is polled (reader notices; UCX progress)


class HoldState(str, enum.Enum):
    HELD = "held"  # pages hold the K/V; readers may read them
    REVOKING = "revoking"  # ended; a read may still be in flight: pages stay out of use


@dataclass(eq=False)
class Hold:
    request_id: str
    token: str  # PullSource.hold: Unhold must show it
    item: object  # the PrefillItem: its sequence owns the pages, its sink is the Prefill call
    slot: int
    epoch: int
    transport: str  # the read side its reader uses (PullSource.transport)
    reader: str = ""  # the decode worker it was held for (Prefill.reader; for ReaderGone)
    state: HoldState = HoldState.HELD
    unlocked: bool = False  # the revoke held the slot's write lock: no fenced read is in flight
    read_over: bool = False  # no one-sided (NIXL) read can be in flight: said, noticed, or timed out
    deadline: float | None = None  # REVOKING, not read_over: when the fence timeout presumes the reader gone

    @property
    def pages(self) -> int:
        return len(self.item.seq.page_table)


class Holds:
    """Every hold of one prefill worker. Calls come from any thread; `free(item)` gives an item's pages
    back to the pool (the worker caches them first) and is called once per hold, outside this lock."""

    def __init__(self, pool: PoolHost, free: Callable[[object], None], fence_timeout_s: float = 60.0,
                 clock=time.monotonic):
        self.pool, self.free, self.fence_timeout_s, self.clock = pool, free, fence_timeout_s, clock
        self._lock = threading.Lock()
        self.held: dict[str, Hold] = {}
        self.revoking: dict[int, Hold] = {}  # by slot
        self._next_sweep: float | None = None
        self.fence_timeouts = 0  # NIXL holds whose pages came back by the fence timeout alone
        self._wake, self._stopping = threading.Event(), False
        self._poller = None  # a pool with a one-sided transport is polled on a thread of its own (poll)
        if any(not pool.strict(name) for name in pool.endpoints):
            self._poller = threading.Thread(target=self._poll_loop, name="holds-poll", daemon=True)
            self._poller.start()

    def keep(self, item, token: int, logprob: float | None, reader_host: str = "", reader: str = "") -> PullSource:
        """Hold the item's pages for `reader` on `reader_host` (its host identity; empty: unknown, the
        pool's first transport), read over the transport the pool picks for it (PoolHost.choose):
        OutOfPages if every fence slot is taken, TransferFailed if the pool cannot reach that host."""
        transport = self.pool.choose(reader_host) if reader_host else next(iter(self.pool.endpoints))
        slot, epoch = self.pool.lease_slot()
        h = Hold(item.msg.request_id, secrets.token_hex(8), item, slot, epoch, transport, reader)
        with self._lock:
            self.held[h.request_id] = h
            if self._next_sweep is None:
                self._next_sweep = self.clock() + SWEEP_S
        self._wake.set()  # the poller looks at the new hold
        return PullSource(h.request_id, h.token, transport, self.pool.descriptor, list(item.seq.page_table),
                          item.seq.num_tokens - 1, slot, epoch, token, logprob)  # the first token's K/V: decode's

    def end(self, request_id: str, hold: str | None = None, error: BaseException | None = None,
            reader_closed: bool = False) -> bool:
        """End a hold (Unhold shows its id; Abort and the sweep do not). `reader_closed`: the caller knows
        no reader can still read it (see the module doc). False if there is none."""
        with self._lock:
            h = self.held.get(request_id)
            if h is None:
                return False
            if hold is not None and not secrets.compare_digest(h.token, hold):
                raise ProtocolError(f"request {request_id!r}: that hold id is not this request's")
            del self.held[request_id]
            h.state = HoldState.REVOKING
            h.read_over = h.read_over or reader_closed or self.pool.strict(h.transport)
            if not h.read_over:
                h.deadline = self.clock() + self.fence_timeout_s
            self.revoking[h.slot] = h
        if error is not None:
            h.item.sink.fail(error)
        else:
            h.item.sink.send(Ack(), final=True)
        if self.pool.revoke(h.slot, self._fenced):
            self._fenced(h.slot)
        self._wake.set()  # ... and at its fence deadline
        return True

    def _fenced(self, slot: int) -> None:
        """No fenced read can read the slot's pages any more (now, or from the fence's helper thread)."""
        with self._lock:
            h = self.revoking.get(slot)
            if h is not None:
                h.unlocked = True
        self._maybe_free(h)

    def _maybe_free(self, h: Hold | None) -> None:
        """Free a REVOKING hold's pages once no reader of any kind can still read them."""
        with self._lock:
            if h is None or not (h.unlocked and h.read_over) or self.revoking.get(h.slot) is not h:
                return
            del self.revoking[h.slot]
        self.free(h.item)
        self.pool.free_slot(h.slot)

    def reader_gone(self, reader: str) -> None:
        """Decode worker `reader` is dead: none of its reads is in flight, so its holds' pages need not
        wait for its notice (ended ones come back now, held ones when they end)."""
        with self._lock:
            mine = [h for h in (*self.held.values(), *self.revoking.values()) if reader and h.reader == reader]
            for h in mine:
                h.read_over = True
        for h in mine:
            self._maybe_free(h if h.state is HoldState.REVOKING else None)

    def poll_due(self) -> float | None:
        """When the pool should next be polled: often while a NIXL hold may be read (its reader's
        notice; UCX moves a READ over TCP only while this side progresses), else at the next fence
        timeout; None: no hold waits for a reader's notice."""
        with self._lock:
            waiting = [h for h in (*self.held.values(), *self.revoking.values())
                       if not h.read_over and not self.pool.strict(h.transport)]
        if not waiting:
            return None
        return min([self.clock() + POLL_S, *(h.deadline for h in waiting if h.deadline is not None)])

    def _poll_loop(self) -> None:
        """The poller: polls when `poll_due` says so, sleeps otherwise. Its own thread, so that a long
        prefill pass never holds up a NIXL READ over TCP (the target must progress) nor a notice."""
        while not self._stopping:
            due = self.poll_due()
            if due is None:  # nothing to wait for: sleep until a hold is kept or ended
                self._wake.wait()
                self._wake.clear()
                continue
            if (wait := due - self.clock()) > 0:
                self._wake.wait(wait)
                self._wake.clear()
            if not self._stopping:
                self.poll()  # early when woken: harmless

    def poll(self) -> None:
        """Take up the readers' `closed` notices and the fence timeouts that passed (the poller thread:
        the only one that touches the pool's transports after it was made)."""
        closed = self.pool.poll().closed
        now, ready = self.clock(), []
        with self._lock:
            for h in (*self.held.values(), *self.revoking.values()):
                timed_out = h.deadline is not None and now >= h.deadline and not h.read_over
                if (h.slot, h.epoch) in closed or timed_out:
                    h.read_over = True
                    self.fence_timeouts += timed_out
                    ready.append(h)
        for h in ready:
            self._maybe_free(h if h.state is HoldState.REVOKING else None)

    def sweep_due(self) -> float | None:
        with self._lock:
            return self._next_sweep

    def sweep(self) -> bool:
        """End the holds whose caller went away, if a sweep is due. True if any ended."""
        with self._lock:
            if self._next_sweep is None or self.clock() < self._next_sweep:
                return False
            self._next_sweep = self.clock() + SWEEP_S if self.held else None
            gone = [rid for rid, h in self.held.items() if h.item.sink.cancelled()]
        return any([self.end(rid) for rid in gone])

    def pages(self) -> int:
        """Pages held for readers or waiting for a read in flight to end."""
        with self._lock:
            return sum(h.pages for h in (*self.held.values(), *self.revoking.values()))

    def close(self) -> None:
        """The worker stops: every hold ends (their pool goes with the worker), the poller stops."""
        for rid in list(self.held):
            self.end(rid)
        self._stopping = True
        self._wake.set()
        if self._poller is not None:
            self._poller.join()
