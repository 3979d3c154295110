"""The front-door core: the one place a typed request is admitted, prepared, streamed and collected.

Every protocol door is a codec over it (OpenAI HTTP: http_openai.py; KServe v2 over HTTP and Triton
gRPC: kserve_codec.py, http_kserve.py, grpc_door.py):

    request (typed) ──▶ FrontDoor.answer ──▶ Delta, Delta, ... (the last has a finish reason)
                        FrontDoor.collect ──▶ Answer (the whole text, log-probs, token counts)

`answer` prepares the request (tokenized off the event loop, under admission: a refusal is raised
before anything is yielded), admits it, gives it a deadline (its own, or the deployment's), drives the
serving path's token stream (control/serving_path.py: the one generator below this one), turns tokens
into text incrementally and records the latencies clients see. Failures are tandem.status exceptions;
each door shapes them for its protocol through the one status table. Nothing is ever streamed twice.

The prompt-echo rule lives here only: a request with `exclude_input=False` gets its prompt in front of
the first delta's text (and so in front of a collected answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from control.orchestrator import Orchestrator
from engine.detokenizer import TextStream
from frontdoor.door_metrics import RequestClock
from frontdoor.requests import GenerationRequest
from frontdoor.served_model import ServedModel
from tandem.status import TandemError, status_of


@dataclass(frozen=True)
class Delta:
    text: str  # new final text (may be empty: a partial character, or a held-back stop prefix)
    token: int | None
    logprob: float | None
    finish_reason: str | None = None
    cached_tokens: int = 0  # on the first delta: prompt tokens taken from a prefix cache, not computed
    prompt_tokens: int = 0  # the prompt's length in tokens (on every delta)


@dataclass(frozen=True)
class Answer:
    """A whole answer, as the collector gathers it from the deltas."""

    text: str
    logprobs: tuple[float, ...]  # one per token when the request asked for them, else empty
    tokens: int
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int


class FrontDoor:
    """The served model (`served`: its names, config and statistics) behind every protocol door."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.service: Orchestrator = served.service

    async def answer(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """The request's deltas; raises a TandemError (before the first delta when it is refused).

        The one generator between the serving path's tokens and a protocol codec."""
        svc, stats_start, ok = self.service, time.perf_counter(), False
        try:
            prep = await svc.prepare(req)
            n_in = len(prep.prompt_ids)
            clock = RequestClock(svc.metrics, svc.mode, svc.admission.admit(n_in))  # refused at once when full
            try:
                text = TextStream(svc.tokenizer, prep.params.stop)
                echo = "" if prep.request.exclude_input else (prep.request.prompt or "")
                deadline = time.monotonic() + (prep.request.timeout_s or svc.timeout_s)
                async with contextlib.aclosing(svc.path.run(prep, deadline)) as tokens:
                    async for tok in tokens:
                        piece = text.add(tok.token) if tok.token is not None else ""
                        if tok.finish_reason:
                            piece += text.flush()
                        cached = 0
                        if tok.token is not None and clock.token():  # the first token
                            cached = min(tok.cached_tokens, n_in)
                            piece, echo = echo + piece, ""
                        yield Delta(piece, tok.token, tok.logprob, tok.finish_reason, cached, n_in)
                        if tok.finish_reason:
                            break
                clock.finished()
                ok = True
            finally:
                clock.close()
        except TandemError as e:
            svc.metrics.failures.labels(status_of(e).value).inc()
            raise
        finally:
            self.served.stats.record(ok, stats_start)

    async def collect(self, req: GenerationRequest) -> Answer:
        """The whole answer of one request (the one collector every door uses)."""
        text, logprobs, n, reason, n_in, cached = [], [], 0, None, 0, 0
        async with contextlib.aclosing(self.answer(req)) as deltas:  # a cancel cleans up at once
            async for d in deltas:
                text.append(d.text)
                if d.token is not None:
                    n += 1
                    if d.logprob is not None:
                        logprobs.append(d.logprob)
                reason, n_in, cached = d.finish_reason or reason, d.prompt_tokens, cached or d.cached_tokens
        return Answer("".join(text), tuple(logprobs), n, reason, n_in, cached)

    async def collect_all(self, reqs: list[GenerationRequest]) -> list[Answer]:
        """Whole answers of a batch, served concurrently; the first failure cancels the others."""
        if len(reqs) == 1:
            return [await self.collect(reqs[0])]
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.collect(r)) for r in reqs]
        except BaseExceptionGroup as group:  # the status of the first failure, as a single request's
            raise group.exceptions[0] from None
        return [t.result() for t in tasks]
