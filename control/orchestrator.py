"""The orchestrator service: what the front-door core (frontdoor/core.py) serves requests with.

It holds the serving path (control/serving_path.py), the tokenizer and limits, admission and metrics,
and the deadline a request gets when it brings none. `prepare` validates and tokenizes (off the event
loop: a long prompt never stalls other requests or health checks); `refuse_if_closed` refuses at once
while draining or over an admission limit. Every failure is a tandem.status exception; the front doors
map its status to their protocol's codes in one table (tandem/status.py).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from engine.tokenizer import Tokenizer
from control.admission import Admission
from control.serving_path import ServingPath
from control.requests import GenerationRequest, Limits, Prepared, guides, prepare
from tandem.modes import Mode
from tandem.status import TandemError, Unavailable, status_of
from tandem.tracing import NO_SPAN, NOOP, Span, Tracer


class Orchestrator:
    def __init__(self, *, path: ServingPath, tokenizer: Tokenizer, limits: Limits, metrics,
                 admission: Admission | None = None, timeout_s: float = 600.0, mode: Mode = Mode.DISAGGREGATED,
                 tracer: Tracer = NOOP):
        """`metrics`: the deployment's series (frontdoor/door_metrics.py Metrics), which the doors and the
        serving path record into; the orchestrator counts refusals there (`metrics.refused(status)`).
        `tracer`: where the requests' spans go (tandem/tracing.py; NOOP: tracing off)."""
        self.tracer = tracer
        self.path, self.tokenizer, self.limits, self.metrics = path, tokenizer, limits, metrics
        guides(tokenizer, limits).warm()  # here, not on the first guided request's preparation
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

    async def prepare(self, req: GenerationRequest, span: Span = NO_SPAN) -> Prepared:
        """The request validated and tokenized; `span` (its admission) gets a `tandem.tokenize` child."""
        with span.child("tandem.tokenize") as tokenize:
            prep = await self.off_loop(prepare, req, self.tokenizer, self.limits)
            tokenize.set(prompt_tokens=len(prep.prompt_ids))
            return prep

    async def off_loop(self, fn, *args):
        """fn(*args) on the preparation threads (tokenizer work), holding an admission place while it
        runs: refused at once while draining or when full, so tokenizing never lets more work in than
        admission allows (a request is admitted right after, with no await between)."""
        self._refuse_if_draining()
        with self.admission.prepare():
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

