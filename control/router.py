"""Routing policies: which prefill and which decode (or co-located) worker take a request.

A policy is a small class behind one interface; the fleet keeps each worker's load (its own
accounting, plus the stats the workers push) and the serving path asks the policy. Workers given to
a policy are routable ones (healthy, not draining); a policy raises NoWorker when the list is empty.
- least-loaded (default): prefill with the fewest prompt tokens queued or in flight; decode with
  enough free pages and the fewest running requests.
- round-robin: each role in turn (tests, and a baseline for the policy itself).
- kv-aware: the pair with the lowest expected cost, counting the prompt tokens each worker already
  holds in its prefix cache (control/prefix_index.py) against its load.

`pick_pair` is what a serving path asks: a decode (or co-located) worker, and a prefill worker or None
when the decode worker is to prefill the request itself (conditional disaggregation: what it lacks of
the prompt is at most `Demand.local_max` tokens, or there are no prefill workers at all).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from control.fleet import WorkerState
from policies.routing import least_loaded_decode, least_queued_prefill, most_free
from tandem.status import Unavailable


class NoWorker(Unavailable):
    """No routable worker of the role right now (a restart may bring one back before the deadline)."""


@dataclass(frozen=True)
class Demand:
    """What one attempt of a request needs."""

    tokens: int  # to prefill: prompt + tokens already streamed
    pages: int  # KV pages it holds at most (prompt + max_tokens)
    tokens_per_page: int
    cached: Callable[[WorkerState], int]  # leading tokens a worker holds in its prefix cache (advisory)
    local_max: int = 0  # a decode worker lacking at most this many tokens prefills them itself (0: never)

    def lacks(self, w: WorkerState) -> int:
        """Prompt tokens the worker would compute (at least 1: the last one always is)."""
        return self.tokens - self.cached(w)

    def local_on(self, decode: WorkerState) -> bool:
        return self.lacks(decode) <= self.local_max

    def fits(self, w: WorkerState) -> bool:
        """The worker has free pages for what it lacks (unknown counts as yes)."""
        return w.pages_free is None or w.pages_free >= self.pages - self.cached(w) // self.tokens_per_page


class Router(ABC):
    @abstractmethod
    def pick_prefill(self, workers: list[WorkerState], tokens: int) -> WorkerState: ...

    @abstractmethod
    def pick_decode(self, workers: list[WorkerState], pages: int) -> WorkerState:
        """A decode (or co-located) worker for a request needing `pages` KV pages."""

    def pick_pair(self, prefills: list[WorkerState], decodes: list[WorkerState],
                  demand: Demand) -> tuple[WorkerState, WorkerState | None]:
        """(decode, prefill); prefill None: the decode worker prefills the request itself."""
        d = self.pick_decode(decodes, demand.pages)
        if not prefills or demand.local_on(d):
            return d, None
        return d, self.pick_prefill(prefills, demand.tokens)


def _some(workers: list[WorkerState], role: str) -> list[WorkerState]:
    if not workers:
        raise NoWorker(f"no healthy {role} worker")
    return workers


def _queued(w: WorkerState) -> int:
    reported = w.stats.queued_tokens if w.stats is not None else 0
    return max(w.inflight_tokens, reported)


def _by_name(workers: list[WorkerState], role: str) -> list[WorkerState]:
    return sorted(_some(workers, role), key=lambda w: w.name)


class LeastLoaded(Router):
    """policies/routing.py's choice (ties by worker name)."""

    def pick_prefill(self, workers: list[WorkerState], tokens: int) -> WorkerState:
        return least_queued_prefill(_by_name(workers, "prefill"), _queued)

    def pick_decode(self, workers: list[WorkerState], pages: int) -> WorkerState:
        alive = _by_name(workers, "decode")
        d = least_loaded_decode(alive, fits=lambda w: w.pages_free is None or w.pages_free >= pages,
                                running=lambda w: w.running, pages_free=lambda w: w.pages_free or 0)
        return d or most_free(alive, pages_free=lambda w: w.pages_free or 0)


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


class KvAware(LeastLoaded):
    """The (prefill, decode) pair, or the decode worker alone, with the lowest expected cost, in prompt
    tokens of work: a prefill costs what is queued on its worker plus the tokens it lacks of the prompt;
    the handoff costs MOVE per token the decode worker lacks (copying KV is ~50x cheaper than computing
    it here); a local prefill costs the tokens the decode worker lacks, plus STALL of them per request
    it is streaming (they wait for that pass); each request a decode worker streams costs RUNNING.
    Workers short of free pages for what they lack are considered only when none has enough."""

    MOVE = 0.02
    STALL = 0.25
    RUNNING = 32

    def pick_pair(self, prefills, decodes, demand):
        alive = _some(decodes, "decode")
        pool = [w for w in alive if demand.fits(w)] or [max(alive, key=lambda w: w.pages_free or 0)]
        p = min(prefills, key=lambda w: (self._prefill_cost(w, demand), w.name)) if prefills else None
        # remote cost = the prefill's + the decode's share, so the best prefill is the same for every decode
        d = min(pool, key=lambda w: (self._cost(w, p, demand)[0], w.name))
        return d, None if self._cost(d, p, demand)[1] else p

    @staticmethod
    def _prefill_cost(w: WorkerState, demand: Demand) -> float:
        return _queued(w) + demand.lacks(w)

    def _cost(self, d: WorkerState, p: WorkerState | None, demand: Demand) -> tuple[float, bool]:
        """(expected cost, whether d prefills it itself) of serving the request on decode worker d."""
        lacks, load = demand.lacks(d), self.RUNNING * d.running
        if p is None or demand.local_on(d):
            return lacks * (1 + self.STALL * d.running) + load, True
        return self._prefill_cost(p, demand) + self.MOVE * lacks + load, False


ROUTERS = {"least-loaded": LeastLoaded, "round-robin": RoundRobin, "kv-aware": KvAware}
