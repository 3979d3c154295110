"""A simulated decode worker: a KV page pool and continuous batching (engine/workers/decode_worker.py).

Pages are reserved for prompt + max_tokens when the request is routed, before its prefill. A
request joins the running batch at the first step that starts after its K/V arrived (at most
`max_batch` run; later ones wait in arrival order, or by priority: policies/prefill_passes.py `in_turn`,
as the decode loop orders them). Every step runs all running sequences and
takes the profile's decode time for (batch size, context tokens). A request's pages are freed at
the end of the step that produced its last token.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.costs import PassCosts
from planner.sim.batch import RunningBatch
from planner.sim.events import EventLoop
from planner.sim.pages import PagePool
from planner.sim.request import SimRequest
from policies.prefill_passes import in_turn


class DecodeSim:
    def __init__(self, loop: EventLoop, costs: PassCosts, pool: PagePool, *, max_batch: int,
                 on_done: Callable[[SimRequest], None]):
        """`on_done(req)` is called when a request's last token is out and its pages are free."""
        self.loop = loop
        self.costs = costs
        self.pool = pool
        self.max_batch = max_batch
        self.on_done = on_done
        self.batch = RunningBatch()
        self.joining: list[SimRequest] = []  # K/V arrived, not yet in the batch: in arrival order
        self.holding = 0  # requests with pages reserved here (routing: "running")
        self.busy = False
        self._pending = False

    def can_reserve(self, req: SimRequest) -> bool:
        return self.pool.can_reserve(req.budget)

    def reserve(self, req: SimRequest) -> None:
        req.pages = self.pool.reserve(req.budget, self.loop.now)
        req.reserved_at = self.loop.now
        self.holding += 1

    def drop(self, req: SimRequest) -> list[float]:
        """Preempted: out of the batch (or the wait to join it), its pages freed; the times of the tokens
        its attempt produced (none if its K/V had not arrived)."""
        produced = req.attempt_times()
        if req in self.joining:
            self.joining.remove(req)
        elif req.steps is self.batch.step_ends:
            self.batch.leave(req)
        self.pool.free(req.pages, self.loop.now)
        self.holding -= 1
        return produced

    def arrive(self, req: SimRequest) -> None:
        """The request's K/V (and first token) are here."""
        if req.output_len == 1:
            self._finish(req)
            return
        self.joining.append(req)
        if not self.busy and not self._pending:
            self._pending = True
            self.loop.soon(self._start)

    def _start(self) -> None:
        self._pending = False
        if self.busy:
            return
        room = self.max_batch - self.batch.size
        if self.joining and room > 0:
            joined = in_turn(self.joining, _priority)[:room]
            for req in joined:
                self.batch.join(req)
            taken = set(map(id, joined))
            self.joining = [r for r in self.joining if id(r) not in taken]
        if self.batch.size == 0:
            return
        self.busy = True
        self.loop.at(self.loop.now + self.costs.decode_time(self.batch.size, self.batch.context_tokens), self._end)

    def _end(self) -> None:
        now = self.loop.now
        for req in self.batch.step_done(now):
            req.done_at = now
            self._finish(req)
        self.busy = False
        self._pending = True
        self.loop.soon(self._start)

    def _finish(self, req: SimRequest) -> None:
        if req.output_len == 1:
            req.done_at = req.first_token
        self.pool.free(req.pages, self.loop.now)
        self.holding -= 1
        self.on_done(req)


def _priority(req: SimRequest) -> int:
    return req.priority
