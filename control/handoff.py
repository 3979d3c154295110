"""The handoff protocols, orchestrator side: one attempt of one request on a decode and a prefill worker.
Two of them, chosen per deployment (`handoff: {mode: push|pull}`): push (`Handoff`, below), where the
decode worker reserves first and the prefill worker writes into its pages, and pull (`PullAttempt`,
control/pull_attempt.py), where the prefill worker keeps the K/V in its own pool and the decode worker
reads them. Push:

    OPEN      decode.open(prompt, writer)  -> Reserved(lease, destination: pages + fence slot/epoch)
      │       the Open call stays open for the request's whole life (a long answer goes on over Continue
      │       calls, DecodeClient.open): the reservation lives exactly as long as they do; it cannot
      │       expire while the prompt waits in a live prefill worker's queue
    PREFILL   prefill(prompt, destination) -> the first token; the prefill worker writes each layer's
      │       K/V straight into the leased pages while the next layer computes
    FIRST     the first token goes to the client at once (a first token that ends the request: done)
    START     decode.start(lease, first token) -> the Open call streams the remaining tokens
    DONE      the decode worker ended the Open call and freed the pages

Every exit that is not DONE ends the lease with a Release (sent without waiting, so a request that
is being torn down never blocks on it) and, if the prefill is still running, an Abort; if this
process dies, Triton cancels its calls and the workers drop them. No KV byte passes through here.

Why no late writer can land a write in pages another request holds (the fence):
- a lease's pages go back to the free list only when the decode worker knows its writer is done:
  the prefill answered (Start, or Release with writer_closed), or the writer was fenced out;
- shm (and inproc): the writer checks the lease's epoch in the pool's fence table under a read lock
  around every layer copy; the decode worker revokes the slot under the write lock. After a revoke no
  check can pass and no copy can be in flight (it would hold the lock), whatever the writer does next,
  even if it was stopped and resumes later;
- NIXL: writes are one-sided RDMA into registered memory and cannot be checked remotely. The writer
  sends a `done` or `closed` notice after its last WRITE completed (or after draining them on abort);
  until that notice, or until the writer is known dead, a released lease's pages stay quarantined
  (`pages_fenced` in the worker's stats). A writer that is neither heard from nor known dead within
  the fence timeout (60 s) is presumed gone: the one bounded assumption, documented in docs/.
A request resumed after a failure carries the tokens already streamed (`sent`): they are prefilled
with the prompt and not streamed again.

Prefix cache: the reservation says how many leading tokens the decode worker already holds
(Reserved.cached_tokens; its destination starts after them, so no writer is ever handed a shared
cached page); the prefill worker computes only what its own cache lacks and writes only what the
decode worker lacks. The first token carries the prefill worker's cached count (what the client saved).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from control.fleet import WorkerState
from tandem.sampling_params import SamplingParams
from tandem.status import TandemError, Unavailable
from tandem.tracing import NO_SPAN, Span
from tandem.wire import Open, Prefill, Prefilled, Pulled, Reserved, Start, Token


@dataclass
class Timings:
    start: float = field(default_factory=time.perf_counter)
    reserved: float = 0.0
    first_token: float = 0.0
    transport: str = ""  # how the pages travelled (the decode worker chose it for this pair)
    prefilled: Prefilled | None = None
    decode_cached: int = 0  # prompt tokens the decode worker already held (none of their KV was moved)
    pulled: Pulled | None = None  # pull: the decode worker's read
    pulled_at: float = 0.0


def blame(e: TandemError, worker: WorkerState) -> TandemError:
    """Tag an error with the worker it came from (the retry loop avoids that worker next time)."""
    if getattr(e, "worker", None) is None:
        e.worker = worker
    return e


async def first_of(stream, expected: type, worker: WorkerState, before: str):
    """The first message of a worker's stream, which must be an `expected`: a failure, an end or any other
    message is that worker's fault (Unavailable, saying what came instead `before` what)."""
    try:
        msg = await anext(stream, None)
    except TandemError as e:
        raise blame(e, worker) from None
    if not isinstance(msg, expected):
        what = "ended the stream" if msg is None else f"answered with {type(msg).__name__}"
        raise blame(Unavailable(f"{worker.name} {what} {before}"), worker)
    return msg


def first_token(first: Prefilled) -> Token:
    """The client's first token from a prefill worker's answer (push and pull alike)."""
    return Token(first.token, first.logprob, first.finish_reason, cached_tokens=first.cached_tokens,
                 top=first.top, prompt_logprobs=first.prompt_logprobs)


class Attempt:
    """One try of one request on one choice of workers, used as `async with attempt: await attempt.next()`.

    `next()` is a plain coroutine (no generator layer between a worker's stream and the serving path):
    it returns the next token, or None after the token with a finish reason. A worker stream that ends
    without one is that worker's fault (Unavailable). Errors are tagged with the failing worker.
    Leaving the `async with` ends whatever the attempt still holds on its workers, then calls `on_exit`
    (the serving path gives back the load it claimed for the attempt)."""

    def __init__(self, decode: WorkerState, request_id: str, span: Span = NO_SPAN):
        """`span`: the attempt's `tandem.attempt` span; its workers' spans hang under it (wire traceparent)."""
        self.decode, self.request_id, self.span = decode, request_id, span
        self.on_exit: list[Callable[[], None]] = []
        self.opened = None  # the decode worker's Open stream (control/channel.py), once opened
        self.finished = False  # the token with a finish reason was returned: next() gives None
        self.ended = False  # the worker itself ended the request (its stream's last token): nothing to release
        self.placed = False  # its decode (or co-located) worker leased its pages: no longer waiting for them
        self.on_placed: Callable[[], None] | None = None  # told when `placed` turns true

    async def next(self) -> Token | None:
        raise NotImplementedError

    def mark_placed(self) -> None:
        """The workers reserved its pages: it no longer waits for them."""
        self.placed = True
        if self.on_placed is not None:
            self.on_placed()

    def workers(self) -> dict[str, str]:
        """The workers it runs on, by role (span attributes)."""
        return {"decode_worker": self.decode.name}

    async def _stream_next(self) -> Token | None:
        """The decode worker's next token (it is the one to blame for any failure here)."""
        if self.finished:
            return None
        try:
            tok = await anext(self.opened, None)
        except TandemError as e:
            raise blame(e, self._stream_culprit(e)) from None
        if tok is None:
            raise blame(Unavailable(f"{self.decode.name} ended the stream of {self.request_id} without a "
                                    f"finish reason"), self.decode)
        self.finished = self.ended = tok.finish_reason is not None
        return tok

    def _stream_culprit(self, e: TandemError) -> WorkerState:
        """The worker a failure of the decode stream is blamed on: the decode worker's own."""
        return self.decode

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            if self.opened is not None:
                await self.opened.aclose()
        finally:
            for give_back in self.on_exit:
                give_back()


class PairAttempt(Attempt):
    """An attempt on one decode and one prefill worker: what push (Handoff) and pull (PullAttempt) share."""

    MODE = ""  # the handoff it speaks: push (Handoff) or pull (PullAttempt)

    def __init__(self, decode: WorkerState, prefill: WorkerState, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, sent: list[int], timings: Timings, span: Span = NO_SPAN):
        super().__init__(decode, request_id, span)
        self.prefill, self.prompt_ids, self.params, self.sent = prefill, list(prompt_ids), params, list(sent)
        self.timings = timings
        self.on_first: Callable[[], None] | None = None  # called once when the prefill worker answered

    def workers(self) -> dict[str, str]:
        return {**super().workers(), "prefill_worker": self.prefill.name, "handoff": self.MODE}

    def traced_prefill(self, first: Prefilled, span: Span) -> None:
        """The prefill worker's own timings of its answer on the orchestrator's `tandem.prefill` span."""
        span.set(queue_seconds=first.queue_seconds, compute_seconds=first.compute_seconds, kv_bytes=first.kv_bytes,
                 kv_seconds=first.kv_seconds, cached_tokens=first.cached_tokens,
                 transport=self.timings.transport or None, prompt_tokens=len(self.prompt_ids) + len(self.sent))


class Handoff(PairAttempt):
    """The handoff protocol on one decode and one prefill worker (see the module docstring). Traced as
    `tandem.decode_reservation` (OPEN) and `tandem.prefill` (PREFILL) under the attempt's span."""

    MODE = "push"

    def __init__(self, *args):
        super().__init__(*args)
        self.lease, self.writer_running, self.first = "", False, None

    async def next(self) -> Token | None:
        if self.opened is None:
            return await self._first_token()
        if self.first is not None:  # the first token went out: the decode worker takes over from it
            first, self.first = self.first, None
            try:
                await self.decode.client.start(Start(self.request_id, self.lease, first.token, first.logprob))
            except TandemError as e:
                raise blame(e, self.decode) from None
        return await self._stream_next()

    async def _first_token(self) -> Token:
        """OPEN (reserve pages), PREFILL into them: the first token."""
        d, t = self.decode, self.timings
        with self.span.child("tandem.decode_reservation", worker=d.name) as span:
            self.opened = d.client.open(Open(self.request_id, self.prompt_ids, self.params, self.sent,
                                             writer=self.prefill.name, writer_host=self.prefill.host,
                                             traceparent=self.span.traceparent()))
            reserved = await first_of(self.opened, Reserved, d, "before reserving pages")
            span.set(cached_tokens=reserved.cached_tokens, pages=len(reserved.destination.page_ids),
                     transport=reserved.destination.transport)
        self.lease, t.reserved = reserved.lease, time.perf_counter()
        self.mark_placed()
        t.decode_cached, t.transport = reserved.cached_tokens, reserved.destination.transport
        self.writer_running = True
        with self.span.child("tandem.prefill", worker=self.prefill.name) as span:
            try:
                first = await self.prefill.client.prefill(Prefill(self.request_id, self.prompt_ids, self.params,
                                                                  self.sent, reserved.destination,
                                                                  traceparent=span.traceparent()))
            except TandemError as e:
                raise blame(e, self.prefill) from None
            self.writer_running = False  # it answered: its writer is closed, whatever the answer was
            self.traced_prefill(first, span)
        t.first_token, t.prefilled = time.perf_counter(), first
        if self.on_first is not None:
            self.on_first()
        self.finished = first.finish_reason is not None
        if not self.finished:
            self.first = first
        return first_token(first)

    async def __aexit__(self, *exc) -> None:
        """Every exit that is not DONE: Release the lease (without waiting), Abort a running prefill."""
        if self.writer_running:
            self.prefill.client.abort(self.request_id)
        if not self.ended and self.lease:  # a first token that ends the request leaves the lease to release
            self.decode.client.release(self.request_id, self.lease, writer_closed=not self.writer_running)
        await super().__aexit__(*exc)
