"""The orchestrator service: one request in, a stream of text deltas out, whatever the serving path.

`prepare` validates and tokenizes (off the event loop: a long prompt never stalls other requests or
health checks); `stream` admits the request (or refuses it at once: frontdoor/admission.py), gives
it a deadline, lets the serving path (control/serving_path.py) produce its tokens, detokenizes them
incrementally and records the latencies clients see. Every failure is a tandem.status exception; the
front doors map its status to their protocol's codes in one table (tandem/status.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.detokenizer import TextStream
from engine.tokenizer import Tokenizer
from frontdoor.admission import Admission
from frontdoor.door_metrics import Metrics
from control.serving_path import ServingPath
from frontdoor.requests import GenerationRequest, Limits, Prepared, prepare
from tandem.status import Status, TandemError, Unavailable, status_of


@dataclass(frozen=True)
class Delta:
    text: str  # new final text (may be empty: a partial character, or a held-back stop prefix)
    token: int | None
    logprob: float | None
    finish_reason: str | None = None
    cached_tokens: int = 0  # on the first delta: prompt tokens taken from a prefix cache, not computed


class Orchestrator:
    def __init__(self, *, path: ServingPath, tokenizer: Tokenizer, limits: Limits, metrics: Metrics,
                 admission: Admission | None = None, timeout_s: float = 600.0, mode: str = "disaggregated"):
        self.path, self.tokenizer, self.limits, self.metrics = path, tokenizer, limits, metrics
        self.admission = admission or Admission()
        self.timeout_s, self.mode = timeout_s, mode
        self.draining = False
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")

    def ready(self) -> bool:
        return not self.draining and self.path.ready()

    def refuse_if_closed(self, ahead: int = 0) -> None:
        """Raise at once when no new request can be taken (draining, or over an admission limit with
        `ahead` more requests on their way in): the front doors call this before they read a request's
        body, so a refusal costs almost nothing. A refusal is counted in the metrics."""
        try:
            self._refuse_if_draining()
            self.admission.check(ahead)
        except TandemError as e:
            self.metrics.refused(status_of(e))
            raise

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise Unavailable("the server is shutting down; send the request to another replica")

    async def prepare(self, req: GenerationRequest) -> Prepared:
        """The validated, tokenized request; a refusal (draining, over a limit, invalid) is counted."""
        arrived = time.perf_counter()
        try:
            self._refuse_if_draining()
            loop = asyncio.get_running_loop()
            with self.admission.prepare():  # checks the limits, then holds a place until `stream` admits it
                prep = await loop.run_in_executor(self._pool, prepare, req, self.tokenizer, self.limits)
        except TandemError as e:
            self.metrics.refused(status_of(e))
            raise
        return dataclasses.replace(prep, arrived=arrived)

    async def stream(self, prep: Prepared) -> AsyncIterator[Delta]:
        """Text deltas of one request; raises a TandemError (nothing is ever streamed twice)."""
        meter = self.metrics.start(prep.arrived or time.perf_counter())
        try:
            self._refuse_if_draining()
            ticket = self.admission.admit(len(prep.prompt_ids))  # ResourceExhausted at once when over a limit
        except TandemError as e:
            meter.failed(status_of(e))
            raise
        meter.admitted(len(prep.prompt_ids))
        text = TextStream(self.tokenizer, prep.params.stop)
        timeout = prep.request.timeout_s or self.timeout_s
        n = 0
        try:
            tokens = self.path.serve(prep, time.monotonic() + timeout)
            async with contextlib.aclosing(tokens) as stream:
                async for tok in stream:
                    piece = text.add(tok.token) if tok.token is not None else ""
                    if tok.finish_reason:
                        piece += text.flush()
                    if tok.token is not None:
                        n += 1
                        meter.token()
                        if n == 1:
                            ticket.first_token()
                    cached = min(tok.cached_tokens, len(prep.prompt_ids)) if n == 1 and tok.token is not None else 0
                    yield Delta(piece, tok.token, tok.logprob, tok.finish_reason, cached)
                    if tok.finish_reason:
                        meter.done(tok.finish_reason)
                        break
        except TandemError as e:
            meter.failed(status_of(e))
            raise
        finally:
            ticket.close()
            meter.failed(Status.CANCELLED)  # the client left (the stream closed early); no-op if it ended

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

