"""Serving paths: how one request is served, chosen once when the stack starts.

- `DisaggregatedPath`: a decode worker leases pages, a prefill worker computes the prompt into them
  (control/handoff.py), the decode worker streams the rest; or, with the pull handoff
  (control/pull_attempt.py), the prefill worker computes into its own pages first and the decode
  worker reads them; or, with TensorRT-LLM role workers (control/trtllm_attempt.py), TensorRT-LLM's
  context phase answers first and its generation side pulls the K/V itself. Conditional disaggregation: when the chosen decode worker lacks at most
  `local_max` tokens of the prompt (the rest is in its prefix cache), it prefills them itself and no
  prefill worker is involved.
- `ColocatedPath`: one of N co-located replicas does both (the baselines: prefill-first or chunked).

Both go through the same router and the same `run` loop, which resumes a failed request elsewhere:
prompt + tokens already streamed are prefilled again and the stream continues without repeating a
token. A full pool (OUT_OF_PAGES) or no routable worker makes the request wait for the fleet to change
(pages freed, a worker back), bounded by the request's deadline, behind any request of a better priority
waiting too; a full pool first preempts a running request of a worse priority there, which waits and
resumes in turn (control/waiting_room.py); a retryable failure tries another
worker, at most `max_retries` times; anything else ends the request with its status.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from control.adapters import Adapters
from control.fleet import Fleet, WorkerState
from control.handoff import Attempt, Handoff, Timings
from control.prefix_index import PrefixView
from control.pull_attempt import PullAttempt
from control.router import Demand, NoWorker, Router
from control.trtllm_attempt import TrtllmAttempt
from control.waiting_room import Preempted, Seat, WaitingRoom
from tandem.modes import HandoffMode, Mode
from tandem.roles import Role
from tandem.status import (DeadlineExceeded, InvalidArgument, OutOfPages, Status, TandemError, Unavailable, retryable,
                           status_of)
from tandem.tracing import NO_SPAN, Span
from tandem.wire import Open, Token

log = logging.getLogger("tandem.paths")
HANDOFFS = {HandoffMode.PUSH: Handoff, HandoffMode.PULL: PullAttempt,
            "trtllm": TrtllmAttempt}  # trtllm: backend tensorrt-llm (TensorRT-LLM pulls the K/V itself)


class ServingPath(ABC):
    roles: tuple[Role, ...]

    def __init__(self, fleet: Fleet, router: Router, tokens_per_page: int, metrics, max_retries: int = 2,
                 prefix: PrefixView | None = None, local_max: int = 0, handoff: str = HandoffMode.PUSH,
                 adapters: Adapters | None = None):
        """`prefix`: what the workers cache (fed by their stats); `local_max`: see DisaggregatedPath;
        `handoff`: push (control/handoff.py), pull (control/pull_attempt.py) or trtllm
        (control/trtllm_attempt.py: TensorRT-LLM workers, which never prefill locally: use local_max 0);
        `adapters`: the LoRA adapters served (control/adapters.py), each held while a request uses it."""
        if handoff not in HANDOFFS:
            raise ValueError(f"unknown handoff mode {handoff!r}; allowed: {', '.join(HANDOFFS)}")
        self.handoff = HANDOFFS[handoff]
        self.fleet, self.router, self.metrics = fleet, router, metrics
        self.tokens_per_page, self.max_retries = tokens_per_page, max_retries
        self.prefix = prefix if prefix is not None else PrefixView(tokens_per_page)
        self.local_max = local_max
        self.adapters = adapters if adapters is not None else Adapters()
        self.room = WaitingRoom(fleet)
        self._ids = itertools.count()

    def ready(self) -> bool:
        return self.fleet.ready(self.roles)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_page)

    @abstractmethod
    def attempt(self, prep, sent: list[int], avoid: set[str], request_id: str, span: Span = NO_SPAN) -> Attempt:
        """One try on one choice of workers (routing happens here: NoWorker, OutOfPages, InvalidArgument),
        traced under `span` (its `tandem.attempt`)."""

    async def run(self, prep, deadline: float, span: Span = NO_SPAN) -> AsyncIterator[Token]:
        """The request's tokens, resuming after failures; raises the final TandemError.

        The one generator between a worker's stream and the front door: each attempt's `next()` is
        awaited under the request's deadline (monotonic), never held across a `yield`. Each attempt is a
        `tandem.attempt` span under `span` (a resumed one says so: `resumed`, `resumed_after_tokens`)."""
        sent: list[int] = []
        avoid: set[str] = set()
        failures, tries = 0, itertools.count()  # tries: every attempt's id is new to the workers
        uid = f"{next(self._ids)}:{prep.request.request_id}"
        waited: TandemError | None = None  # why the request is waiting (full pools, no worker), if it is
        # its LoRA adapter stays on the workers until the end; it leaves the waiting room however it ends
        with self.adapters.hold(prep.params.lora), self.room.visit(uid, prep.params.priority) as seat:
            while True:
                version, attempt = self.fleet.version, None
                try:
                    with span.child("tandem.attempt", retry=failures, resumed=failures > 0,
                                    resumed_after_tokens=len(sent)) as traced:
                        rid = f"{uid}#{next(tries)}.{len(sent)}"  # a preempted one may still be open there
                        async with self.attempt(prep, sent, avoid, rid, traced) as attempt:
                            traced.set(**attempt.workers())
                            attempt.on_placed = lambda: self.room.leave(uid)
                            seat.take(attempt.decode.name, lambda a=attempt: a.opened is not None)
                            attempt.on_exit.append(seat.vacate)
                            while (tok := await _step(attempt, deadline, seat)) is not None:
                                if waited is not None and attempt.placed:  # it waited, and has its pages now
                                    waited = None
                                if tok.token is not None:
                                    sent.append(tok.token)
                                if tok.finish_reason is not None:  # done: the caller may close us at this yield
                                    traced.set(finish_reason=tok.finish_reason)
                                    traced.end()
                                yield tok
                    return
                except (OutOfPages, NoWorker) as e:
                    if isinstance(e, Preempted):  # its pages went to a more urgent request: it waits for some
                        self.metrics.preemptions.inc()
                        log.info("request %s: preempted after %d token(s)", uid, len(sent))
                    elif isinstance(e, OutOfPages):
                        self.room.make_room(prep.params.priority, getattr(getattr(e, "worker", None), "name", None))
                    waited = e
                    if not await self.room.wait(uid, prep.params.priority, version, deadline):
                        raise _gave_up(e) from None
                except DeadlineExceeded as e:
                    if attempt is not None and attempt.placed:  # it waited, then got its pages: its own deadline
                        waited = None
                    raise _gave_up(waited) if waited is not None else e from None
                except TandemError as e:
                    worker = getattr(e, "worker", None)
                    if not retryable(status_of(e)) or failures >= self.max_retries:
                        raise
                    failures += 1
                    if worker is not None:
                        avoid.add(worker.name)
                        if status_of(e) is Status.UNAVAILABLE:
                            self.fleet.mark_unreachable(worker, str(e))
                    self.metrics.recoveries.labels(worker.role if worker else "unknown").inc()
                    log.info("request %s: %s; resuming after %d token(s)", uid, e, len(sent))

    def _check_fits(self, role: Role, pages: int) -> None:
        """A request no pool could ever hold is the client's to fix, not something to wait for."""
        largest = max((w.stats.pages_total for w in self.fleet.role(role) if w.stats), default=0)
        if largest and pages > largest:
            raise InvalidArgument(f"the request needs {pages} KV pages (prompt + max_tokens) but the largest "
                                  f"{role} pool has {largest}; lower max_tokens or shorten the prompt")

    def _demand(self, prep, sent: list[int], local_max: int) -> Demand:
        ids = list(prep.prompt_ids) + sent
        lookup = self.prefix.lookup(ids, prep.params.cache_salt, prep.params.lora)
        pages = self.pages_for(len(ids) + prep.params.max_tokens - len(sent))
        return Demand(len(ids), pages, self.tokens_per_page, lambda w: lookup.tokens(w.name), local_max)

    def _local(self, w: WorkerState, prep, sent: list[int], request_id: str, span: Span) -> Attempt:
        """The request on one decode or co-located worker that prefills it itself (against its cache)."""
        self.metrics.requests.labels(w.slot, w.role).inc()
        return self._claim(LocalAttempt(w, Open(request_id, list(prep.prompt_ids), prep.params, list(sent),
                                                local_prefill=True, traceparent=span.traceparent()), span), w)

    def _claim(self, attempt: Attempt, w: WorkerState) -> Attempt:
        """Count the attempt on its decode worker until it ends (the router's load)."""
        w.running += 1

        def give_back() -> None:
            w.running -= 1
            if w.draining and not w.running:
                self.fleet.poke()  # its drain waits for this (not a request waiting for pages: it would wake itself)

        attempt.on_exit.append(give_back)
        return attempt

    def _pick(self, role: Role, avoid: set[str]) -> list[WorkerState]:
        """Routable workers of the role, preferring those that did not just fail this request."""
        workers = self.fleet.routable(role)
        return [w for w in workers if w.name not in avoid] or workers


class LocalAttempt(Attempt):
    """A worker that prefills the request itself: its Open stream carries every token."""

    def __init__(self, w: WorkerState, msg: Open, span: Span = NO_SPAN):
        super().__init__(w, msg.request_id, span)
        self.msg = msg

    async def next(self) -> Token | None:
        if self.opened is None:
            self.opened = self.decode.client.open(self.msg)
        tok = await self._stream_next()
        if not self.placed:  # the worker leased its pages at the Open
            self.mark_placed()
        return tok

    async def __aexit__(self, *exc) -> None:
        if self.opened is not None and not self.ended:
            self.decode.client.release(self.request_id, "", writer_closed=True)
        await super().__aexit__(*exc)


class DisaggregatedPath(ServingPath):
    roles = Mode.DISAGGREGATED.roles

    def attempt(self, prep, sent, avoid, request_id, span=NO_SPAN) -> Attempt:
        demand = self._demand(prep, sent, self.local_max)
        n_ctx = demand.tokens
        self._check_fits(Role.DECODE, demand.pages)
        d, p = self.router.pick_pair(self._pick(Role.PREFILL, avoid), self._pick(Role.DECODE, avoid), demand)
        if p is None:
            if not demand.local_on(d):  # no prefill worker, and too much for the decode worker to compute
                raise NoWorker("no healthy prefill worker")
            self.metrics.local_prefills.labels(d.slot).inc()
            return self._local(d, prep, sent, request_id, span)
        m, timings = self.metrics, Timings()
        m.requests.labels(d.slot, Role.DECODE).inc()
        m.requests.labels(p.slot, Role.PREFILL).inc()
        h = self._claim(self.handoff(d, p, request_id, prep.prompt_ids, prep.params, sent, timings, span), d)
        p.inflight_tokens += n_ctx  # the prefill worker's queue, until it answers
        pending = [n_ctx]

        def prefill_ended() -> None:
            if pending:
                p.inflight_tokens -= pending.pop()

        def prefilled() -> None:
            prefill_ended()
            m.record_prefill(p.slot, timings)

        h.on_first = prefilled
        if isinstance(h, (PullAttempt, TrtllmAttempt)):
            h.on_pulled = lambda: m.record_pull(d.slot, timings)
        h.on_exit.append(prefill_ended)
        return h


class ColocatedPath(ServingPath):
    roles = Mode.COLOCATED.roles

    def attempt(self, prep, sent, avoid, request_id, span=NO_SPAN) -> Attempt:
        demand = self._demand(prep, sent, local_max=0)
        self._check_fits(Role.GENERATE, demand.pages)
        w, _ = self.router.pick_pair([], self._pick(Role.GENERATE, avoid), demand)  # no prefill workers: local
        return self._local(w, prep, sent, request_id, span)


PATHS = {Mode.DISAGGREGATED: DisaggregatedPath, Mode.COLOCATED: ColocatedPath, Mode.CHUNKED: ColocatedPath}


def make_path(mode: Mode | str, fleet: Fleet, router: Router, tokens_per_page: int, metrics, max_retries: int,
              local_prefill_tokens: int = 0, handoff_mode: str = HandoffMode.PUSH,
              adapters: Adapters | None = None) -> ServingPath:
    """The path for `mode`; it follows the workers' prefix caches through the fleet's stats callback."""
    if mode not in PATHS:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(PATHS)}")
    view = PrefixView(tokens_per_page)
    before = fleet.on_stats

    def on_stats(w: WorkerState) -> None:
        if before is not None:
            before(w)
        view.observe(w.name, w.stats)

    fleet.on_stats = on_stats
    return PATHS[mode](fleet, router, tokens_per_page, metrics, max_retries, view, local_prefill_tokens,
                       handoff_mode, adapters)


def _gave_up(why: TandemError) -> TandemError:
    """What a request that waited until its deadline ends with: a full pool is OUT_OF_PAGES (429), no
    worker UNAVAILABLE (503); both tell the client to retry."""
    if isinstance(why, OutOfPages):
        return OutOfPages(f"no KV pages became free before the request's deadline ({why})")
    return Unavailable(f"{why}, and none came back before the request's deadline")


async def _step(attempt: Attempt, deadline: float, seat: Seat) -> Token | None:
    """The attempt's next token, awaited no later than the request's deadline (monotonic); Preempted when
    a more urgent request took the seat's pages (before, or while, it waits for the token)."""
    if seat.preempted:
        raise Preempted()
    seat.stepping = task = asyncio.current_task()
    try:
        # asyncio.timeout, not wait_for: wait_for runs the await in another task and can lose a cancel
        # that arrives as that task ends (the request would go on for a client that left)
        async with asyncio.timeout_at(deadline):
            return await attempt.next()
    except TimeoutError:
        raise DeadlineExceeded("the request's deadline passed before it finished") from None
    except asyncio.CancelledError:
        if seat.preempted and task.uncancel() == 0:  # the preemption's cancel alone, not the client's
            raise Preempted() from None
        raise
    finally:
        seat.stepping = None
