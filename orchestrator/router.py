"""Routing policies: which prefill and which decode (or co-located) worker take a request.

A policy is a small class behind one interface; the fleet keeps each worker's load (its own
accounting, plus the stats the workers push) and the serving path asks the policy. Workers given to
a policy are routable ones (healthy, not draining); a policy raises NoWorker when the list is empty.
- least-loaded (default): prefill with the fewest prompt tokens queued or in flight; decode with
  enough free pages and the fewest running requests.
- round-robin: each role in turn (tests, and a baseline for the policy itself).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod

from orchestrator.fleet import WorkerState
from tandem.status import Unavailable


class NoWorker(Unavailable):
    """No routable worker of the role right now (a restart may bring one back before the deadline)."""


class Router(ABC):
    @abstractmethod
    def pick_prefill(self, workers: list[WorkerState], tokens: int) -> WorkerState: ...

    @abstractmethod
    def pick_decode(self, workers: list[WorkerState], pages: int) -> WorkerState:
        """A decode (or co-located) worker for a request needing `pages` KV pages."""


def _some(workers: list[WorkerState], role: str) -> list[WorkerState]:
    if not workers:
        raise NoWorker(f"no healthy {role} worker")
    return workers


def _queued(w: WorkerState) -> int:
    reported = w.stats.queued_tokens if w.stats is not None else 0
    return max(w.inflight_tokens, reported)


class LeastLoaded(Router):
    def pick_prefill(self, workers: list[WorkerState], tokens: int) -> WorkerState:
        return min(_some(workers, "prefill"), key=lambda w: (_queued(w), w.name))

    def pick_decode(self, workers: list[WorkerState], pages: int) -> WorkerState:
        alive = _some(workers, "decode")
        fitting = [w for w in alive if w.pages_free is None or w.pages_free >= pages]
        # none fits now: the one with the most free pages answers OUT_OF_PAGES or takes it
        pool = fitting or [max(alive, key=lambda w: w.pages_free or 0)]
        return min(pool, key=lambda w: (w.running, -(w.pages_free or 0), w.name))


class RoundRobin(Router):
    def __init__(self):
        self._turn = {"prefill": itertools.count(), "decode": itertools.count()}

    def _next(self, workers: list[WorkerState], role: str) -> WorkerState:
        alive = sorted(_some(workers, role), key=lambda w: w.name)
        return alive[next(self._turn[role]) % len(alive)]

    def pick_prefill(self, workers: list[WorkerState], tokens: int) -> WorkerState:
        return self._next(workers, "prefill")

    def pick_decode(self, workers: list[WorkerState], pages: int) -> WorkerState:
        return self._next(workers, "decode")


ROUTERS = {"least-loaded": LeastLoaded, "round-robin": RoundRobin}
