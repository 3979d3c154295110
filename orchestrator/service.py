"""The orchestrator service: one request in, a stream of text deltas out, whatever the serving mode.

- disaggregated: a decode worker (free pages, fewest running) reserves pages, a prefill worker
  (fewest prompt tokens in flight) computes the prompt straight into them, the first token streams
  at once, then the decode worker's stream (see orchestrator/handoff.py).
- colocated / chunked: one `generate` worker does both phases.

Failures: a decode pool that is full makes the request wait (queue) and try again; a worker that
cannot be reached is marked unhealthy (a poller re-probes it) and the request resumes on another
one: prompt + tokens already streamed are prefilled again and the stream continues without
repeating a token. A bad request fails at once with BadRequest; nothing is retried for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.detokenizer import TextStream
from engine.tokenizer import Tokenizer
from orchestrator.handoff import HandoffError, Stage, Timings, Token, handoff
from orchestrator.metrics import Metrics
from orchestrator.requests import BadRequest, GenerationRequest, Prepared, Unavailable, prepare
from orchestrator.router import NoWorker, Router, WorkerState
from orchestrator.worker_client import ColocatedClient, DecodeClient, PrefillClient, WorkerError

MODES = ("disaggregated", "colocated", "chunked")


@dataclass(frozen=True)
class Delta:
    text: str  # new final text (may be empty: a partial character, or a held-back stop prefix)
    token: int | None
    logprob: float | None
    finish_reason: str | None = None


class Orchestrator:
    def __init__(self, *, mode: str, tokenizer: Tokenizer, max_context: int, router: Router, metrics: Metrics,
                 prefill_urls: list[str] = (), decode_urls: list[str] = (), generate_urls: list[str] = (),
                 tokens_per_page: int = 16, max_retries: int = 2, queue_timeout_s: float = 300.0,
                 poll_interval_s: float = 0.5):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
        self.mode, self.tokenizer, self.max_context = mode, tokenizer, max_context
        self.router, self.metrics = router, metrics
        self.max_retries, self.queue_timeout_s, self.poll_interval_s = max_retries, queue_timeout_s, poll_interval_s
        self.prefill = [WorkerState(f"prefill-{i}", "prefill", u, PrefillClient(u)) for i, u in enumerate(prefill_urls)]
        self.decode = [WorkerState(f"decode-{i}", "decode", u, DecodeClient(u), tokens_per_page=tokens_per_page)
                       for i, u in enumerate(decode_urls)]
        self.generate = [WorkerState(f"generate-{i}", "generate", u, ColocatedClient(u))
                         for i, u in enumerate(generate_urls)]
        if mode == "disaggregated" and not (self.prefill and self.decode):
            raise ValueError("disaggregated mode needs at least one prefill and one decode worker")
        if mode != "disaggregated" and not self.generate:
            raise ValueError(f"{mode} mode needs a generate worker")
        self.pages_freed = asyncio.Event()
        self._poller: asyncio.Task | None = None
        self._seq = itertools.count()  # client request ids need not be unique; worker-side ids must be

    @property
    def workers(self) -> list[WorkerState]:
        return self.prefill + self.decode + self.generate

    async def start(self) -> None:
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for w in self.workers:
            await w.client.close()

    def ready(self) -> bool:
        if self.mode == "disaggregated":
            return any(w.healthy for w in self.prefill) and any(w.healthy for w in self.decode)
        return any(w.healthy for w in self.generate)

    # -- health and load ----------------------------------------------------------------------------

    async def poll_once(self) -> None:
        async def one(w: WorkerState):
            try:
                if w.role == "decode":
                    s = await w.client.stats()
                    w.pages_free = s.pages_total - s.pages_used
                    self.metrics.pages_used.labels(w.name).set(s.pages_used)
                    self.metrics.pages_total.labels(w.name).set(s.pages_total)
                    w.healthy = True
                else:
                    w.healthy = await w.client.ready()
            except WorkerError:
                w.healthy = False
        await asyncio.gather(*[one(w) for w in self.workers])

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.poll_once()

    # -- requests -----------------------------------------------------------------------------------

    def prepare(self, req: GenerationRequest) -> Prepared:
        return prepare(req, self.tokenizer, self.max_context)

    async def stream(self, prep: Prepared) -> AsyncIterator[Delta]:
        """Text deltas of one request; raises BadRequest or Unavailable (nothing was streamed twice)."""
        m, mode = self.metrics, self.mode
        text = TextStream(self.tokenizer, prep.params.stop)
        t0 = time.perf_counter()
        first = last = None
        n = 0
        m.in_flight.inc()
        tokens = self._tokens(prep) if mode == "disaggregated" else self._colocated(prep)
        try:
            async with contextlib.aclosing(tokens) as stream:
                async for tok in stream:
                    now = time.perf_counter()
                    piece = text.add(tok.token) if tok.token is not None else ""
                    if tok.finish_reason:
                        piece += text.flush()
                    if tok.token is not None:
                        n += 1
                        m.tokens.labels(mode).inc()
                        if first is None:
                            first = now
                            m.ttft.labels(mode).observe(now - t0)
                        else:
                            m.itl.labels(mode).observe(now - last)
                        last = now
                    yield Delta(piece, tok.token, tok.logprob, tok.finish_reason)
                    if tok.finish_reason:
                        break
        except (BadRequest, Unavailable) as e:
            m.failures.labels(type(e).__name__).inc()
            raise
        finally:
            m.in_flight.dec()
        end = time.perf_counter()
        m.e2e.labels(mode).observe(end - t0)
        if n > 1:
            m.tpot.labels(mode).observe((end - first) / (n - 1))

    async def _tokens(self, prep: Prepared) -> AsyncIterator[Token]:
        """Disaggregated: handoff on a (decode, prefill) pair, resuming elsewhere after a failure."""
        sent: list[int] = []
        failures = 0
        uid = f"{next(self._seq)}:{prep.request.request_id}"
        bad: set[str] = set()
        waited_since = time.perf_counter()
        while True:
            n_ctx = len(prep.prompt_ids) + len(sent)
            try:
                d = self.router.pick_decode([w for w in self.decode if w.name not in bad], n_ctx + prep.params.max_tokens)
                p = self.router.pick_prefill([w for w in self.prefill if w.name not in bad], n_ctx)
            except NoWorker as e:
                raise Unavailable(f"{e}; the request was not completed") from None
            rid = f"{uid}#{failures}.{len(sent)}"
            timings = Timings()
            d.running += 1
            p.inflight_tokens += n_ctx
            prefill_pending = True
            self.metrics.requests.labels(d.name, "decode").inc()
            self.metrics.requests.labels(p.name, "prefill").inc()
            try:
                async with contextlib.aclosing(handoff(p.client, d.client, rid, prep.prompt_ids, prep.params,
                                                       sent, timings)) as stream:
                    async for tok in stream:
                        if prefill_pending:
                            prefill_pending = False
                            p.inflight_tokens -= n_ctx
                            self._record_prefill(p, timings, waited_since)
                        if tok.token is not None:
                            sent.append(tok.token)
                        yield tok
                return
            except HandoffError as e:
                kind = e.error.kind
                if kind == "invalid_argument":
                    raise BadRequest(str(e.error)) from None
                if kind == "out_of_pages":
                    await self._wait_for_pages(waited_since)
                    continue
                failures += 1
                worker = d if e.stage in (Stage.RESERVE, Stage.GENERATE) else p
                if kind == "unreachable":
                    worker.healthy = False
                bad.add(worker.name)
                self.metrics.recoveries.labels(e.stage.value).inc()
                if failures > self.max_retries:
                    raise Unavailable(f"request failed after {failures} attempts: {e}") from None
            finally:
                d.running -= 1
                if prefill_pending:
                    p.inflight_tokens -= n_ctx
                self.pages_freed.set()

    def _record_prefill(self, p: WorkerState, t: Timings, arrived: float) -> None:
        m = self.metrics
        m.queue.labels("decode").observe(max(0.0, t.start - arrived) + (t.reserved - t.start))
        m.queue.labels("prefill").observe(max(0.0, (t.first_token - t.reserved) - t.prefill_seconds - t.kv_seconds))
        m.prefill.labels(p.name).observe(t.prefill_seconds)
        m.kv_bytes.labels(p.name).inc(t.kv_bytes)
        m.kv_seconds.labels(p.name).observe(t.kv_seconds)

    async def _wait_for_pages(self, since: float) -> None:
        if time.perf_counter() - since > self.queue_timeout_s:
            raise Unavailable(f"no decode worker had free KV pages for {self.queue_timeout_s:.0f}s")
        self.pages_freed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.pages_freed.wait(), timeout=0.05)

    async def _colocated(self, prep: Prepared) -> AsyncIterator[Token]:
        """Co-located baselines: one worker does both phases; a full pool makes the request wait."""
        waited_since = time.perf_counter()
        while True:
            try:
                w = min([g for g in self.generate if g.healthy] or self.generate, key=lambda g: (g.running, g.name))
            except ValueError:
                raise Unavailable("no generate worker") from None
            w.running += 1
            self.metrics.requests.labels(w.name, "generate").inc()
            try:
                rid = f"{next(self._seq)}:{prep.request.request_id}"
                async for token, logprob, reason in w.client.generate(rid, prep.prompt_ids, prep.params.to_dict()):
                    yield Token(token, logprob, reason)
                return
            except WorkerError as e:
                if e.kind == "invalid_argument":
                    raise BadRequest(str(e)) from None
                if e.kind == "out_of_pages":
                    await self._wait_for_pages(waited_since)
                    continue
                if e.kind == "unreachable":
                    w.healthy = False
                raise Unavailable(f"generate worker failed: {e}") from None
            finally:
                w.running -= 1
                self.pages_freed.set()
