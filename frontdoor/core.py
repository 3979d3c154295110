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

The scope rule: under per-key isolation a request's cache salt is scoped to its API key's holder
(tandem/prefix.scoped_salt) before it is prepared. The echo rule: what a prepared request echoes
(`Prepared.echo`: its prompt, or a chat's last assistant message) leads the first delta's text.

The served model (`ServedModel`): its names, Triton config and metadata, and statistics. gRPC and KServe
HTTP serve it as `triton_name` (`ensemble`, TensorRT-LLM's name); the OpenAI API as `served_name` (vLLM's
--served-model-name), accepting its aliases, the Triton name and its LoRA adapters' names."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass

from control.orchestrator import Orchestrator
from engine.detokenizer import TextStream
from frontdoor.model_contract import INPUTS, OUTPUTS, model_config
from frontdoor.schedule_policy import PriorityLevels
from control.requests import GenerationRequest
from tandem.logprobs import Logprob
from tandem.prefix import scoped_salt
from tandem.request_context import api_key_name, cache_scope, client_traceparent, note_tokens
from tandem.status import Status, TandemError, status_of

_ADMITTED, _DONE = object(), object()  # FrontDoor._merged's markers: an answer was admitted, an answer ended
class Stats:
    """Per-model counters for ModelStatistics (perf_analyzer reads them)."""

    def __init__(self):
        self.success = self.fail = self.success_ns = self.fail_ns = 0
        self.last_ms = 0

    def record(self, ok: bool, start: float) -> None:
        ns = int((time.perf_counter() - start) * 1e9)
        if ok:
            self.success, self.success_ns = self.success + 1, self.success_ns + ns
        else:
            self.fail, self.fail_ns = self.fail + 1, self.fail_ns + ns
        self.last_ms = int(time.time() * 1000)

    def to_json(self, name: str) -> dict:
        """Triton's statistics extension over HTTP (GET /v2/models/{m}/stats): one model, version 1.
        Only whole requests are timed here, so queue and compute durations are not reported."""
        duration = lambda count, ns: {"count": count, "ns": ns}  # noqa: E731
        return {"model_stats": [{
            "name": name, "version": "1", "last_inference": self.last_ms, "inference_count": self.success,
            "execution_count": self.success, "batch_stats": [], "memory_usage": [],
            "inference_stats": {"success": duration(self.success, self.success_ns),
                                "fail": duration(self.fail, self.fail_ns)}}]}


class ServedModel:
    def __init__(self, service: Orchestrator, triton_name: str = "ensemble", served_name: str | None = None,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 sampling_defaults: dict | None = None, aliases: tuple[str, ...] = (), adapters: Collection[str] = (),
                 levels: PriorityLevels = PriorityLevels()):
        """`tool_call_parser`: how the model writes a tool call (frontdoor/tool_call_text.py); None: tool_choice
        "auto" is refused. `reasoning_parser`: how it marks its thinking (frontdoor/reasoning_text.py); None:
        all content. `sampling_defaults`: the OpenAI doors' defaults for fields a request leaves out
        (frontdoor/generation_defaults.py). `aliases`: more OpenAI ids a request may name (answers carry
        `served_name`); `adapters`: LoRA adapters' names (control/adapters.py: they change while serving).
        `levels`: how the KServe doors read a priority level (advertised when the service honours priorities)."""
        self.service, self.triton_name, self.served_name = service, triton_name, served_name or triton_name
        self.listed, self.adapters = (self.served_name, *aliases), adapters  # the base model's OpenAI ids first
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.sampling_defaults, self.stats = sampling_defaults or {}, Stats()
        self.levels = levels
        self.config = model_config(triton_name, levels if service.limits.priority_scheduling else None)

    @property
    def openai_names(self) -> tuple[str, ...]:  # what a request's `model` may be
        return (*self.listed, self.triton_name, *self.adapters)

    def known_triton(self, name: str, version: str = "") -> bool:
        return name == self.triton_name and version in ("", "1")

    def known_openai(self, name: str | None) -> bool:
        return name is None or name in self.openai_names

    def answered_as(self, name: str | None) -> str:
        """The model name an answer to a request for `name` carries: the adapter's, else the served name."""
        return name if name in self.adapters else self.served_name

    def metadata(self) -> dict:
        meta = lambda ts: [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.dims]} for t in ts]  # noqa: E731
        return {"name": self.triton_name, "versions": ["1"], "platform": "python", "inputs": meta(INPUTS),
                "outputs": meta(OUTPUTS)}


@dataclass(frozen=True)
class Delta:
    text: str  # new final text (may be empty: a partial character, or a held-back stop prefix)
    token: int | None
    logprob: float | None
    finish_reason: str | None = None
    cached_tokens: int = 0  # on the first delta: prompt tokens taken from a prefix cache, not computed
    prompt_tokens: int = 0  # the prompt's length in tokens (on every delta)
    top: Logprob | None = None  # the token's alternatives, when top_logprobs asked for them
    prompt_logprobs: tuple[Logprob, ...] = ()  # on the first delta, when the request asked (echo) ...
    prompt_ids: tuple[int, ...] = ()  # ... and the prompt's token ids (on the first delta)
    index: int = 0  # which of a request's answers it belongs to (FrontDoor.answer_all): the reply's choice
    stop_reason: str | int | None = None  # on the last delta: the stop string or stop token that ended it (vLLM's)


@dataclass(frozen=True)
class Answer:
    """A whole answer, as the collector gathers it from the deltas."""

    text: str
    logprobs: tuple[float, ...]  # one per token when the request asked for them, else empty
    tokens: int
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    stop_reason: str | int | None = None


class FrontDoor:
    """The served model (`served`: its names, config and statistics) behind every protocol door."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.service: Orchestrator = served.service

    async def answer(self, req: GenerationRequest, on_admitted: Callable[[], None] | None = None
                     ) -> AsyncIterator[Delta]:
        """The request's deltas; raises a TandemError (before the first delta when it is refused).
        `on_admitted` is called once the request is prepared and admitted.

        The one generator between the serving path's tokens and a protocol codec. Traced (when the
        service's tracer is on) as `tandem.request`, a child of the client's traceparent, with children
        `tandem.admission` (its `tandem.tokenize`) and `tandem.stream` (the attempts under it)."""
        svc, stats_start, ok, n_in, last_sent = self.service, time.perf_counter(), False, 0, False
        # the client's deadline counts from arrival: tokenizing and waiting for admission are part of it
        deadline = time.monotonic() + (req.timeout_s or svc.timeout_s)
        meter = svc.metrics.start(stats_start)  # its latencies count from arrival, tokenization included
        span = svc.tracer.start("tandem.request", client_traceparent(), request_id=req.request_id,
                                model=self.served.served_name, mode=svc.mode)
        try:
            with span.child("tandem.admission") as admission:  # salted within the caller's scope, if any
                req = dataclasses.replace(req, cache_salt=scoped_salt(cache_scope(), req.cache_salt))
                prep = await svc.prepare(req, admission)
                n_in = len(prep.prompt_ids)
                ticket = svc.admission.admit(n_in, api_key_name(), req.priority)  # refused at once when full
            meter.admitted(n_in)
            if on_admitted is not None:
                on_admitted()
            try:
                text = TextStream(svc.tokenizer, prep.params.stop, req.skip_special_tokens,
                                  req.include_stop_str_in_output)
                echo = prep.echo
                with span.child("tandem.stream") as stream:
                    async with contextlib.aclosing(svc.path.run(prep, deadline, stream)) as tokens:
                        async for tok in tokens:
                            shown = tok.token is not None and prep.shown(tok.token, tok.finish_reason)
                            piece = text.add(tok.token) if shown else ""
                            if tok.finish_reason:
                                piece += text.flush()
                            cached, prompt_lps, prompt_ids = 0, (), ()
                            if tok.token is not None and meter.token():  # the first token
                                ticket.first_token()  # its prompt is done: admission counts it as queued no more
                                cached, prompt_lps = min(tok.cached_tokens, n_in), tuple(tok.prompt_logprobs)
                                prompt_ids = tuple(prep.prompt_ids)
                                piece, echo = echo + piece, ""
                                stream.set(cached_tokens=cached)
                            if tok.finish_reason:  # the last delta: a caller may close us once it has it
                                stream.set(completion_tokens=meter.tokens, finish_reason=tok.finish_reason)
                                stream.end()
                                span.set(finish_reason=tok.finish_reason)
                                last_sent = True
                            # a prompt-only answer shows no token of its own
                            own = (None, None, None) if req.prompt_only else (tok.token, tok.logprob, tok.top)
                            stop = text.stop_reason(tok.token, prep.params.stop_token_ids) \
                                if tok.finish_reason == "stop" else None
                            yield Delta(piece, own[0], own[1], tok.finish_reason, cached, n_in, own[2], prompt_lps,
                                        prompt_ids, stop_reason=stop)
                            if tok.finish_reason:
                                meter.done(tok.finish_reason)
                                break
                ok = True
            finally:
                ticket.close()
        except BaseException as e:  # a TandemError, or the client leaving (GeneratorExit, CancelledError)
            if isinstance(e, TandemError):
                meter.failed(status_of(e))
            if not (last_sent and isinstance(e, GeneratorExit)):  # closed after its last delta: it went well
                span.fail(e)
            raise
        finally:
            meter.failed(Status.CANCELLED)  # the client left (the stream closed early); no-op once it ended
            self.served.stats.record(ok, stats_start)
            note_tokens(n_in, meter.tokens)  # for the access line
            span.set(prompt_tokens=n_in, completion_tokens=meter.tokens)
            span.end()

    def answer_all(self, reqs: Sequence[GenerationRequest]) -> AsyncIterator[Delta]:
        """The deltas of several answers served concurrently, each marked with its index in `reqs`, in the
        order they come (one request: `answer` itself). More answers than admission ever lets in at once
        are refused (InvalidArgument) before any is served. Nothing is yielded before every answer has been
        admitted, so a refusal of any is raised before the first delta, as for one request; a failure
        after that ends them all (the others are cancelled and give back what they hold)."""
        self.service.admission.check_size(len(reqs), api_key_name())
        return self.answer(reqs[0]) if len(reqs) == 1 else self._merged(reqs)

    async def _merged(self, reqs: Sequence[GenerationRequest]) -> AsyncIterator[Delta]:
        queue: asyncio.Queue = asyncio.Queue()  # Deltas, _ADMITTED and _DONE markers, or an answer's error

        async def pump(i: int, req: GenerationRequest) -> None:
            try:
                async with contextlib.aclosing(self.answer(req, lambda: queue.put_nowait(_ADMITTED))) as deltas:
                    async for d in deltas:
                        queue.put_nowait(dataclasses.replace(d, index=i))
                queue.put_nowait(_DONE)
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait(e)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        held: list[Delta] = []  # deltas that came before every answer was admitted
        waiting = running = len(reqs)
        try:
            while running:
                item = await queue.get()  # each answer ends by itself: its own deadline bounds it
                if isinstance(item, Exception):
                    raise item
                if item is _DONE:
                    running -= 1
                elif item is _ADMITTED:
                    waiting -= 1
                    if not waiting:
                        for d in held:
                            yield d
                        held.clear()
                elif waiting:
                    held.append(item)
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, req: GenerationRequest, on_delta: Callable[[Delta], None] | None = None) -> Answer:
        """The whole answer of one request (the one collector every door uses); `on_delta` sees each delta."""
        text, logprobs, n, reason, n_in, cached, stop = [], [], 0, None, 0, 0, None
        async with contextlib.aclosing(self.answer(req)) as deltas:  # a cancel cleans up at once
            async for d in deltas:
                if on_delta is not None:
                    on_delta(d)
                text.append(d.text)
                if d.token is not None:
                    n += 1
                    if d.logprob is not None:
                        logprobs.append(d.logprob)
                reason, n_in, cached = d.finish_reason or reason, d.prompt_tokens, cached or d.cached_tokens
                stop = d.stop_reason or stop
        return Answer("".join(text), tuple(logprobs), n, reason, n_in, cached, stop)

    async def collect_all(self, reqs: Sequence[GenerationRequest],
                          on_deltas: Sequence[Callable[[Delta], None] | None] = ()) -> list[Answer]:
        """Whole answers of a batch, served concurrently; the first failure cancels the others (more
        answers than admission ever lets in at once are refused first). `on_deltas[i]`, when given, sees
        each delta of answer i."""
        self.service.admission.check_size(len(reqs), api_key_name())
        watch = list(on_deltas) or [None] * len(reqs)
        if len(reqs) == 1:
            return [await self.collect(reqs[0], watch[0])]
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.collect(r, w)) for r, w in zip(reqs, watch)]
        except BaseExceptionGroup as group:  # the status of the first failure, as a single request's
            raise group.exceptions[0] from None
        return [t.result() for t in tasks]
