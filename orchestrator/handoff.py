"""The handoff protocol, orchestrator side: one request through a decode worker and a prefill worker.

    RESERVE    decode.reserve(request, tokens to write, tokens to generate) -> lease (pages, deadline)
       │ fail: no pages / worker down -> nothing to undo; the caller may try another decode worker
    PREFILL    prefill(prompt, destination = decode pool + leased pages + lease token)
       │       the prefill worker writes each layer's K/V straight into the leased pages
       │ fail: release the lease (if the release is lost, the lease expires by itself)
    FIRST      the first token goes to the client at once
       │       a first token that already ends the request -> release the lease, done
    GENERATE   decode.generate(lease) commits the lease; tokens stream until stop/length
       │ fail / client gone: release the lease; the decode worker also frees pages on cancel
    DONE       the decode worker freed the pages when the stream ended

No state can leak pages: every exit either releases the lease, or leaves pages to a worker that
frees them itself (finished stream, cancelled stream, expired lease). No KV bytes pass through here.
A request resumed after a failure carries the tokens already streamed (`sent`): they are prefilled
with the prompt and not streamed again.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.sampling import SamplingParams
from orchestrator.worker_client import DecodeClient, PrefillClient, WorkerError
from tandem.wire import DecodeOp, Destination, PrefillRequest


class Stage(str, enum.Enum):
    RESERVE = "reserve"
    PREFILL = "prefill"
    GENERATE = "generate"


class HandoffError(Exception):
    """A stage failed. `stage` says where; `error.kind` whether another worker may succeed."""

    def __init__(self, stage: Stage, error: WorkerError):
        super().__init__(f"{stage.value} failed: {error}")
        self.stage = stage
        self.error = error


@dataclass
class Timings:
    start: float = field(default_factory=time.perf_counter)
    reserved: float = 0.0
    first_token: float = 0.0
    kv_bytes: int = 0
    kv_seconds: float = 0.0
    prefill_seconds: float = 0.0


@dataclass(frozen=True)
class Token:
    token: int | None  # None: the stream ended without a new token (e.g. finish_reason "abort")
    logprob: float | None
    finish_reason: str | None


async def handoff(prefill: PrefillClient, decode: DecodeClient, request_id: str, prompt_ids: list[int],
                  params: SamplingParams, sent: list[int] = (), timings: Timings | None = None,
                  lease_ms: int = 0) -> AsyncIterator[Token]:
    """Yield the request's tokens after `sent`. Raises HandoffError; never leaves a lease behind.

    Iterate it inside `contextlib.aclosing(...)` so that a consumer that stops early (the client went
    away) still runs the release.
    """
    t = timings or Timings()
    sent = list(sent)  # a snapshot: the caller appends to its own list as tokens stream
    n_ctx = len(prompt_ids) + len(sent)
    try:
        res = await decode.reserve(DecodeOp(op="reserve", request_id=request_id, num_tokens=n_ctx,
                                            max_tokens=params.max_tokens - len(sent), lease_ms=lease_ms))
    except WorkerError as e:
        raise HandoffError(Stage.RESERVE, e) from None
    t.reserved = time.perf_counter()
    released = False

    async def release():
        nonlocal released
        if not released:
            released = True
            try:
                await decode.release(request_id, res.lease)
            except WorkerError:
                pass  # the worker is gone or already freed it; its lease would expire anyway

    try:
        try:
            first = await prefill.prefill(prompt_ids, PrefillRequest(
                request_id, params.to_dict(), Destination(res.pool, res.page_ids, res.lease), list(sent)))
        except WorkerError as e:
            raise HandoffError(Stage.PREFILL, e) from None
        t.first_token = time.perf_counter()
        t.kv_bytes, t.kv_seconds, t.prefill_seconds = first.kv_bytes, first.kv_seconds, first.prefill_seconds
        yield Token(first.token, first.logprob, first.finish_reason)
        if first.finish_reason:
            await release()
            return
        op = DecodeOp(op="generate", request_id=request_id, lease=res.lease, prompt_ids=list(prompt_ids),
                      output_ids=list(sent) + [first.token], sampling=params.to_dict())
        try:
            async for token, logprob, reason in decode.generate(op):
                if token is not None or reason:
                    yield Token(token, logprob, reason)
                if reason:
                    released = True  # the worker freed the pages when it ended the stream
                    return
        except WorkerError as e:
            raise HandoffError(Stage.GENERATE, e) from None
    finally:
        if not released:
            await asyncio.shield(release())
