"""Who gets a worker's pages, by priority: the requests waiting for them, and those holding them.

A request refused for pages (OUT_OF_PAGES) or finding no routable worker sleeps until the fleet
changes (control/fleet.py `wait_change`), then tries again. With `--scheduling-policy priority` it must
not lose the freed pages to a request of a worse priority: after a change, only the waiters of the best
priority waiting try again; the others hold off until each of those is placed (its decode or co-located
worker leased its pages) or gone, which wakes them. Equal priorities try together, as they always did: first
come, first served gives every request priority 0, so nothing changes there (and nobody is woken for
nothing when a waiter is placed: its pages are taken, not freed). A request arriving meanwhile is not
held off: it may use pages the waiters cannot use yet (a backfill); if it takes pages a more urgent waiter
then needs, that one preempts it (below), which costs the newcomer its prefill, not the waiter its place.

Nor does it wait for pages a less urgent request holds (vLLM preempts the same way): a request refused
for pages preempts the least urgent running request of a worse priority on that worker, or, when none
there is worse, on another one, whose freed pages the router then finds (`make_room`; the latest to
arrive among equals; only a request that has opened on its worker, so may hold pages there). The
preempted request's attempt ends, giving its pages back, and it waits here in turn; it resumes as a
failed one does (prompt + its tokens so far prefilled again, the stream going on without repeating a
token; exact, greedy or seeded). First come, first served nobody is ever preempted.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from control.fleet import Fleet
from policies.preemption import least_urgent
from tandem.status import OutOfPages


class Preempted(OutOfPages):
    """The request's attempt gave its pages to a more urgent request; it waits for pages and resumes (the
    serving path's own signal: a client sees it only as OUT_OF_PAGES, if none come before its deadline)."""

    def __init__(self):
        super().__init__("its pages went to a more urgent request")


class Seat:
    """One request's stay: the worker its current attempt runs on (None between attempts), and whether a
    more urgent request took its pages. `preempted` is acted on only where the request awaits its
    worker's next token (control/serving_path.py `_step`), never while a token is on its way out."""

    def __init__(self, priority: int, order: int):
        self.priority, self.order = priority, order
        self.worker: str | None = None
        self.opened: Callable[[], bool] = lambda: False  # whether the attempt opened on `worker` yet
        self.preempted = False
        self.stepping: asyncio.Task | None = None  # the task awaiting the worker's next token, meanwhile

    def take(self, worker: str, opened: Callable[[], bool]) -> None:
        """An attempt on `worker` began; `opened()` says whether it has asked that worker for its pages
        (they are leased at the Open). Until then preempting it frees nothing there: a pull handoff opens
        on its decode worker only after its whole prefill."""
        self.worker, self.opened, self.preempted = worker, opened, False

    def holds(self, worker: str | None) -> bool:
        """Whether it may hold pages on `worker` (None: on any)."""
        return self.worker is not None and worker in (None, self.worker) and self.opened()

    def vacate(self) -> None:
        self.worker, self.preempted = None, False

    def preempt(self) -> None:
        self.preempted = True
        if self.stepping is not None:
            self.stepping.cancel()  # `_step` tells this cancel from the client's (Task.uncancel)


class WaitingRoom:
    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self._waiting: dict[str, int] = {}  # request uid -> its priority (lower goes first)
        self._seats: dict[str, Seat] = {}  # request uid -> its stay
        self._order = itertools.count()

    async def wait(self, uid: str, priority: int, version: int, deadline: float) -> bool:
        """Sleep until the fleet's version moves past `version`, then until no request of a better
        (lower) priority is waiting; the request counts as waiting until `leave(uid)`. False when
        `deadline` (monotonic) passes first."""
        self._waiting[uid] = priority
        if not await self.fleet.wait_change(version, deadline):
            return False
        while self._ahead(priority):
            if not await self.fleet.wait_change(self.fleet.version, deadline):
                return False
        return True

    @contextmanager
    def visit(self, uid: str, priority: int) -> Iterator[Seat]:
        """One request's whole stay: however it ends, it leaves the room."""
        self._seats[uid] = seat = Seat(priority, next(self._order))
        try:
            yield seat
        finally:
            del self._seats[uid]
            self.leave(uid)

    def leave(self, uid: str) -> None:
        """The request is placed or gone: those it held off (all of a worse priority, once it was the
        last of the best) try again. Idempotent."""
        priority = self._waiting.pop(uid, None)
        if priority is not None and self._waiting and not self._ahead(priority + 1):
            self.fleet.poke()

    def make_room(self, priority: int, worker: str | None) -> bool:
        """Preempt the least urgent request of a worse priority than `priority` (the latest to arrive among
        equals): one running on `worker`, the worker that refused the request, if any there is worse; else
        one running on any worker (the router then finds its pages free there). False if none is worse.
        One at a time: while a preempted one is still giving its pages back there (anywhere, for the
        second choice), nobody more."""
        return any(self._preempt_on(priority, where) for where in dict.fromkeys((worker, None)))

    def _preempt_on(self, priority: int, worker: str | None) -> bool:
        there = [s for s in self._seats.values() if s.holds(worker)]
        if any(s.preempted for s in there):
            return True
        victim = least_urgent(there, priority, rank=lambda s: (s.priority, s.order))
        if victim is None:
            return False
        victim.preempt()
        return True

    def _ahead(self, priority: int) -> bool:
        """Whether a request of a better priority than `priority` is waiting."""
        return any(p < priority for p in self._waiting.values())
