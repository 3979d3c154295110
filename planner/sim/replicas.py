"""Co-located replicas behind the orchestrator: each request goes to the least-loaded replica."""

from __future__ import annotations

from collections.abc import Callable

from planner.sim.colocated import ColocatedSim
from planner.sim.pages import PagePool
from planner.sim.request import SimRequest


class Replicas:
    def __init__(self, engines: list[ColocatedSim], on_done: Callable[[SimRequest], None]):
        """`on_done` hears of requests refused here (too big for a replica's pool); the engines report
        the others themselves."""
        self.engines = engines
        self.on_done = on_done

    @property
    def pools(self) -> list[PagePool]:
        return [e.pool for e in self.engines]

    def submit(self, req: SimRequest) -> None:
        pool = self.engines[0].pool
        if pool.pages_for(req.budget) > pool.num_pages:
            req.failed = f"needs {pool.pages_for(req.budget)} KV pages; a replica's whole pool has {pool.num_pages}"
            self.on_done(req)
            return
        i = min(range(len(self.engines)), key=lambda i: (self.engines[i].load, i))
        self.engines[i].submit(req)
