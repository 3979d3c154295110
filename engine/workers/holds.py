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
read it. Ending a hold revokes its slot in this pool's fence table first (engine/transports/fence.py);
readers check their epoch under the slot's read lock around every layer they copy, so after the
revoke no read can start, and the pages are freed only once the revoke held the write lock (a read in
flight, even of a reader stopped mid-copy, keeps them out of use until it ends or its process dies).
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InvalidRequest
from engine.transports.host import PoolHost
from tandem.pool import PullSource
from tandem.wire import Ack

SWEEP_S = 1.0  # while holds exist: how often their callers are checked (a vanished orchestrator)


class HoldState(str, enum.Enum):
    HELD = "held"  # pages hold the K/V; readers may read them
    REVOKING = "revoking"  # ended; a read was in flight when the slot was revoked: pages stay out of use


@dataclass(eq=False)
class Hold:
    request_id: str
    token: str  # PullSource.hold: Unhold must show it
    item: object  # the PrefillItem: its sequence owns the pages, its sink is the Prefill call
    slot: int
    epoch: int
    state: HoldState = HoldState.HELD

    @property
    def pages(self) -> int:
        return len(self.item.seq.page_table)


class Holds:
    """Every hold of one prefill worker. Calls come from any thread; `free(item)` gives an item's pages
    back to the pool (the worker caches them first) and is called once per hold, outside this lock."""

    def __init__(self, pool: PoolHost, transport: str, free: Callable[[object], None], clock=time.monotonic):
        self.pool, self.transport, self.free, self.clock = pool, transport, free, clock
        self._lock = threading.Lock()
        self.held: dict[str, Hold] = {}
        self.revoking: dict[int, Hold] = {}  # by slot
        self._next_sweep: float | None = None

    def keep(self, item, token: int, logprob: float | None) -> PullSource:
        """Hold the item's pages for a reader (OutOfPages if every fence slot is taken)."""
        slot, epoch = self.pool.lease_slot()
        h = Hold(item.msg.request_id, secrets.token_hex(8), item, slot, epoch)
        with self._lock:
            self.held[h.request_id] = h
            if self._next_sweep is None:
                self._next_sweep = self.clock() + SWEEP_S
        return PullSource(h.request_id, h.token, self.transport, self.pool.descriptor, list(item.seq.page_table),
                          item.seq.num_tokens - 1, slot, epoch, token, logprob)  # the first token's K/V: decode's

    def end(self, request_id: str, hold: str | None = None, error: BaseException | None = None) -> bool:
        """End a hold (Unhold shows its id; Abort and the sweep do not). False if there is none."""
        with self._lock:
            h = self.held.get(request_id)
            if h is None:
                return False
            if hold is not None and not secrets.compare_digest(h.token, hold):
                raise InvalidRequest(f"request {request_id!r}: that hold id is not this request's")
            del self.held[request_id]
            h.state = HoldState.REVOKING
            self.revoking[h.slot] = h
        if error is not None:
            h.item.sink.fail(error)
        else:
            h.item.sink.send(Ack(), final=True)
        if self.pool.revoke(h.slot, self._fenced):
            self._fenced(h.slot)
        return True

    def _fenced(self, slot: int) -> None:
        """No reader can read the slot's pages any more (now, or from the fence's helper thread)."""
        with self._lock:
            h = self.revoking.pop(slot, None)
        if h is not None:
            self.free(h.item)
            self.pool.free_slot(slot)

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
        """The worker stops: every hold ends (their pool goes with the worker)."""
        for rid in list(self.held):
            self.end(rid)
