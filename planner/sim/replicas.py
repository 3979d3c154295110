"""Co-located replicas behind the orchestrator (ColocatedPath and the least-loaded router).

Each request is opened on the replica that has free pages for it and, among those, holds the
fewest requests (then has the most free pages), as control/router.py picks (policies/routing.py). When
no replica has the pages, the request waits in the orchestrator and retries on any replica after pages are
freed anywhere (waiting.py): one wait for the whole fleet, not a queue per replica. A request refused
for pages preempts one of a worse priority, on the replica that refused it (the one with the most free
pages) first, which waits and resumes.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.sim.colocated import ColocatedSim
from planner.sim.events import EventLoop
from planner.sim.pages import PagePool
from planner.sim.request import SimRequest
from planner.sim.waiting import FleetWait, Holders
from policies.routing import least_loaded_decode, most_free


class Replicas:
    def __init__(self, loop: EventLoop, engines: list[ColocatedSim], on_done: Callable[[SimRequest], None]):
        """`on_done` hears of every request that ends: finished, or refused (too big for a replica's
        pool). The engines must report theirs to `self.finished`."""
        self.engines = engines
        self.on_done = on_done
        self.wait = FleetWait(loop, self._try_open, self._make_room)
        self.holders = Holders()  # requests opened and not finished, and on which replica
        self.preemptions = 0

    @property
    def pools(self) -> list[PagePool]:
        return [e.pool for e in self.engines]

    def submit(self, req: SimRequest) -> None:
        pool = self.engines[0].pool
        if pool.pages_for(req.budget) > pool.num_pages:
            req.failed = f"needs {pool.pages_for(req.budget)} KV pages; a replica's whole pool has {pool.num_pages}"
            self.on_done(req)
            return
        self.wait.submit(req)

    def _try_open(self, req: SimRequest) -> bool:
        e = least_loaded_decode(self.engines, fits=lambda e: e.can_open(req), running=lambda e: e.load,
                                pages_free=lambda e: e.pool.pages_free)
        if e is None:
            return False
        e.open(req)
        self.holders.add(req, e)
        return True

    def _make_room(self, priority: int) -> bool:
        """As Disaggregated._make_room, over the replicas."""
        victim = self.holders.least_urgent(priority, most_free(self.engines, lambda e: e.pool.pages_free))
        if victim is None:
            return False
        victim.preempted(self.holders.pop(victim).drop(victim))
        self.preemptions += 1
        self.wait.requeue(victim)
        return True

    def finished(self, req: SimRequest) -> None:
        """An engine finished `req` and freed its pages."""
        self.holders.pop(req)
        self.on_done(req)
        self.wait.pages_freed()
