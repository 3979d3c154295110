"""Requests that found every KV pool full, waiting in the orchestrator for the fleet to change.

As in control/serving_path.py: a request's Open either reserves its pages at once or is answered
OUT_OF_PAGES; the request then sleeps until some worker's state changes (pages freed) and tries
again, at most once per change, and waits again if its pages are still not there. There is no
queue inside a worker and no head-of-line blocking within a priority: every waiting request of the
best priority waiting tries, oldest first, and a small one can get pages a large one could not. As in
control/waiting_room.py, those of a worse priority hold off until each of the better ones is placed
(all priorities equal, first come first served: everyone tries); a new request tries at once.
A request refused for pages preempts one of a worse priority holding pages (`make_room`, the
system's: the least urgent, the latest to arrive among equals, on the worker that refused it if any
there is worse, else on any: policies/preemption.py), one per round as the waiting room
does: the round ends, and the freed pages are tried a round trip later, the most urgent first. The
preempted request waits here and resumes (planner/sim/request.py). All priorities equal, nobody is
preempted.

A retry is not instant: the worker that freed pages pushes its stats to the orchestrator, which
wakes the waiting requests, routes them and sends their Opens. By then the worker has already
begun its next step (its loop does not wait for callers), so a retried request is seen at the step
after that. `RETRY_DELAY_S` stands for that round trip; its exact value does not matter as long as
it is shorter than a step and longer than zero.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from planner.sim.events import EventLoop
from planner.sim.request import SimRequest
from policies.preemption import least_urgent

RETRY_DELAY_S = 1e-3  # stats push + wake-up + Open over loopback gRPC: about a millisecond


class FleetWait:
    def __init__(self, loop: EventLoop, try_open: Callable[[SimRequest], bool],
                 make_room: Callable[[int], bool], retry_delay_s: float = RETRY_DELAY_S):
        """`try_open(req)` routes the request and reserves its pages, or returns False (OUT_OF_PAGES);
        `make_room(priority)` preempts a holder of a worse priority (False: none), which requeue()s."""
        self.loop = loop
        self.try_open = try_open
        self.make_room = make_room
        self.retry_delay_s = retry_delay_s
        self.waiting: list[SimRequest] = []  # in arrival order
        self._retry_due = False
        self.retries = 0  # Open calls answered OUT_OF_PAGES on a retry (for tests and reports)

    def submit(self, req: SimRequest) -> None:
        """A new request: it tries at once; if no pool has room it waits for the next change."""
        if not self.try_open(req):
            self.waiting.append(req)
            self.make_room(req.priority)

    def requeue(self, req: SimRequest) -> None:
        """A preempted request waits again, in arrival order; its pages are free."""
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: r.arrival)
        self.pages_freed()

    def pages_freed(self) -> None:
        """Some worker freed pages: every waiting request tries again after the round trip."""
        if self.waiting and not self._retry_due:
            self._retry_due = True
            self.loop.at(self.loop.now + self.retry_delay_s, self._retry)

    def _retry(self) -> None:
        """Every class in turn, the best first; a class with a request still refused holds off the rest."""
        self._retry_due = False
        placed = set()
        classes = sorted({r.priority for r in self.waiting})
        for priority in classes:
            refused = False  # (one class: no copy; a preemption changes the list, and ends the loop at once)
            for req in self.waiting if len(classes) == 1 else [r for r in self.waiting if r.priority == priority]:
                if self.try_open(req):
                    placed.add(id(req))
                    continue
                self.retries += 1
                first, refused = not refused, True
                if first and self.make_room(priority):  # asked once a class: the answer holds all round
                    break  # one preemption a round: its pages are tried after the round trip
            if refused:
                break
        self.waiting = [r for r in self.waiting if id(r) not in placed]


class Holders:
    """The requests holding pages, each with where they are held (a worker): whom `least_urgent` picks from."""

    def __init__(self) -> None:
        self.where: dict[int, tuple[SimRequest, object]] = {}  # request index -> (request, its worker)
        self.classes: Counter[int] = Counter()  # holders per priority: most rounds need no scan

    def add(self, req: SimRequest, worker: object) -> None:
        self.where[req.index] = (req, worker)
        self.classes[req.priority] += 1

    def worker(self, req: SimRequest):
        return self.where[req.index][1]

    def pop(self, req: SimRequest):
        """Its worker, forgotten (None if it held nothing)."""
        held = self.where.pop(req.index, None)
        if held is None:
            return None
        self.classes[req.priority] -= 1
        return held[1]

    def least_urgent(self, priority: int, worker: object) -> SimRequest | None:
        """The holder a request of `priority` refused by `worker` preempts (policies/preemption.py): the least
        urgent of a worse priority on that worker, else on any; None if none is worse."""
        if not any(n and p > priority for p, n in self.classes.items()):
            return None
        held = list(self.where.values())
        victim = least_urgent((r for r, w in held if w is worker), priority, _rank)
        return victim if victim is not None else least_urgent((r for r, _ in held), priority, _rank)


def _rank(req: SimRequest) -> tuple[int, float, int]:
    return req.priority, req.arrival, req.index
