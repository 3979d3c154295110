"""A simulated co-located engine (engine/workers/decode_worker.py with no pool for writers), with the two
batching policies of engine/scheduler.py (policies/batching.py).

A request is opened here by the orchestrator (replicas.py) only when its pages fit: Open reserves
pages for prompt + max_tokens at once (or is answered OUT_OF_PAGES, and the request waits outside,
see waiting.py), and the prompt joins the waiting queue; it is seen at the next step that starts.
- prefill-first (`chunk_tokens=None`): each step takes waiting prompts in order while the batch has
  room and the pass stays within `pass_tokens` (a single longer prompt runs alone); if any were
  taken, one prefill pass of them runs (the running decodes pause), else one decode step of all running.
- chunked (`chunk_tokens=N`): every step decodes one token for each running sequence and adds up to
  N prompt tokens of waiting prompts, oldest first, priced as one pass (PassCosts.mixed_time).
"Oldest" is the queue's order (policies/batching.py `enqueue`): arrival, or by priority.
Pages are freed when the request finishes.

The batch cap (`max_batch`: running + being prefilled) is the rendered model repository's
`max_batch_size`, as in the engine's scheduler.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from planner.costs import PassCosts
from planner.sim.batch import RunningBatch
from planner.sim.events import EventLoop
from planner.sim.pages import PagePool
from planner.sim.request import SimRequest
from policies.batching import admit, chunk_split, enqueue


class ColocatedSim:
    def __init__(self, loop: EventLoop, costs: PassCosts, pool: PagePool, *, pass_tokens: int, max_batch: int,
                 chunk_tokens: int | None, on_done: Callable[[SimRequest], None]):
        self.loop = loop
        self.costs = costs
        self.pool = pool
        self.pass_tokens = pass_tokens
        self.max_batch = max_batch
        self.chunk_tokens = chunk_tokens
        self.on_done = on_done
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[list] = []  # [request, prompt tokens done] (chunked), in admission order
        self.in_pass = 0  # admitted into the prefill pass now running (prefill-first)
        self.batch = RunningBatch()
        self.busy = False
        self._pending = False

    @property
    def load(self) -> int:
        """Requests opened here and not finished (the router's `running`: they hold pages here)."""
        return self.batch.size + len(self.prefilling) + self.in_pass + len(self.waiting)

    def can_open(self, req: SimRequest) -> bool:
        return self.pool.can_reserve(req.budget)

    def open(self, req: SimRequest) -> None:
        """Reserve the request's pages (the caller checked can_open) and queue its prompt."""
        req.pages = self.pool.reserve(req.budget, self.loop.now)
        req.reserved_at = self.loop.now
        enqueue(self.waiting, req, lambda r: r.priority)
        self._kick()

    def drop(self, req: SimRequest) -> list[float]:
        """Preempted: out of the queue, the prefill or the batch, its pages freed; the times of the tokens
        its attempt produced. A pass under way with its prompt ends for nothing (`_prefilled`, `_mixed_end`)."""
        produced = req.attempt_times()
        if req in self.waiting:
            self.waiting.remove(req)
        elif req.steps is self.batch.step_ends:
            self.batch.leave(req)
        elif any(entry[0] is req for entry in self.prefilling):
            self.prefilling = [entry for entry in self.prefilling if entry[0] is not req]
        else:  # in the prefill-first pass now running
            self.in_pass -= 1
        self.pool.free(req.pages, self.loop.now)
        return produced

    def _kick(self) -> None:
        if not self.busy and not self._pending:
            self._pending = True
            self.loop.soon(self._start)

    def _start(self) -> None:
        self._pending = False
        if self.busy:
            return
        if self.chunk_tokens is None:
            self._prefill_first()
        else:
            self._mixed()

    def _admit(self, token_budget: float) -> list[SimRequest]:
        """Waiting prompts (their pages are held) for this step, oldest first, within the budget."""
        room = self.max_batch - self.batch.size - len(self.prefilling)
        n = admit(self.waiting, lambda r: r.prompt_len, token_budget, room)
        return [self.waiting.popleft() for _ in range(n)]

    def _prefill_first(self) -> None:
        now = self.loop.now
        group = self._admit(self.pass_tokens)
        if group:
            for req in group:
                if math.isnan(req.prefill_start):  # its first pass (a resumed request's was before)
                    req.prefill_start = now
            self.in_pass = len(group)
            self._run(self.costs.prefill_time([(0, r.prompt_len) for r in group]), self._prefilled, group,
                      [r.attempt for r in group])
        elif self.batch.size:
            self._run(self.costs.decode_time(self.batch.size, self.batch.context_tokens), self._decoded)

    def _mixed(self) -> None:
        now = self.loop.now
        for req in self._admit(float("inf")):
            if math.isnan(req.prefill_start):
                req.prefill_start = now
            self.prefilling.append([req, 0])
        split = chunk_split([req.prompt_len - done for req, done in self.prefilling], self.chunk_tokens)
        chunks = [(done, n) for (_, done), n in zip(self.prefilling, split)]
        rows = self.batch.size
        if chunks or rows:
            self._run(self.costs.mixed_time(chunks, rows, self.batch.context_tokens), self._mixed_end,
                      self.prefilling[:len(chunks)], chunks, rows)

    def _run(self, seconds: float, then: Callable, *args) -> None:
        self.busy = True
        self.loop.at(self.loop.now + seconds, self._step_end, then, args)

    def _step_end(self, then: Callable, args: tuple) -> None:
        then(*args)
        self.busy = False
        self._kick()

    def _prefilled(self, group: list[SimRequest], attempts: list[int]) -> None:
        self.in_pass = 0
        for req, attempt in zip(group, attempts):
            if req.attempt == attempt:  # not preempted meanwhile
                self._first_token(req)

    def _decoded(self) -> None:
        for req in self.batch.step_done(self.loop.now):
            self._finish(req)

    def _mixed_end(self, entries: list[list], chunks: list[tuple[int, int]], rows: int) -> None:
        if rows:
            self._decoded()
        for entry, (_, n) in zip(entries, chunks):
            if not any(e is entry for e in self.prefilling):
                continue  # preempted meanwhile
            entry[1] += n
            if entry[1] == entry[0].prompt_len:
                self.prefilling.remove(entry)
                self._first_token(entry[0])

    def _first_token(self, req: SimRequest) -> None:
        req.first_token = self.loop.now
        if req.output_len == 1:
            self._finish(req)
        else:
            self.batch.join(req)

    def _finish(self, req: SimRequest) -> None:
        req.done_at = self.loop.now
        self.pool.free(req.pages, self.loop.now)
        self.on_done(req)
