"""Routing policies: which prefill and which decode worker take a request.

A policy is a small class behind one interface; the service keeps each worker's load in a
`WorkerState` (its own accounting, refreshed by the decode workers' stats) and asks the policy.
- least-loaded (default): prefill with the fewest prompt tokens in flight; decode with enough free
  pages and the fewest running requests.
- round-robin: each role in turn (tests, and a baseline for the policy itself).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class WorkerState:
    name: str
    role: str  # prefill | decode | generate
    url: str
    client: object
    healthy: bool = True
    inflight_tokens: int = 0  # prompt tokens sent and not yet answered (prefill)
    running: int = 0  # requests holding pages or streaming (decode, generate)
    pages_free: int | None = None  # last reported (decode)
    tokens_per_page: int = 16


class NoWorker(RuntimeError):
    """No healthy worker of the role can take the request now."""


class Router(ABC):
    @abstractmethod
    def pick_prefill(self, workers: list[WorkerState], tokens: int) -> WorkerState: ...

    @abstractmethod
    def pick_decode(self, workers: list[WorkerState], tokens: int) -> WorkerState: ...


def _healthy(workers: list[WorkerState], role: str) -> list[WorkerState]:
    alive = [w for w in workers if w.healthy]
    if not alive:
        raise NoWorker(f"no healthy {role} worker")
    return alive


def _fits(w: WorkerState, tokens: int) -> bool:
    return w.pages_free is None or w.pages_free * w.tokens_per_page >= tokens


class LeastLoaded(Router):
    def pick_prefill(self, workers: list[WorkerState], tokens: int) -> WorkerState:
        return min(_healthy(workers, "prefill"), key=lambda w: (w.inflight_tokens, w.name))

    def pick_decode(self, workers: list[WorkerState], tokens: int) -> WorkerState:
        alive = _healthy(workers, "decode")
        fitting = [w for w in alive if _fits(w, tokens)] or alive  # none fits: the reserve decides (may queue)
        return min(fitting, key=lambda w: (w.running, -(w.pages_free or 0), w.name))


class RoundRobin(Router):
    def __init__(self):
        self._turn = {"prefill": itertools.count(), "decode": itertools.count()}

    def _next(self, workers: list[WorkerState], role: str) -> WorkerState:
        alive = _healthy(workers, role)
        return alive[next(self._turn[role]) % len(alive)]

    def pick_prefill(self, workers: list[WorkerState], tokens: int) -> WorkerState:
        return self._next(workers, "prefill")

    def pick_decode(self, workers: list[WorkerState], tokens: int) -> WorkerState:
        return self._next(workers, "decode")


ROUTERS = {"least-loaded": LeastLoaded, "round-robin": RoundRobin}
