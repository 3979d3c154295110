"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (SSE when streaming).

The model id is the served model's name (ServedModel.served_name); its Triton name is an alias. A
client that disconnects mid-stream cancels its request (one debug line, no traceback); a failure
after the stream began is sent as a last SSE event carrying the status, then [DONE].
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from aiohttp import web

from frontdoor import openai_api as oa
from frontdoor.http_body import read_object, request_timeout
from frontdoor.openai_fields import UnknownFields
from frontdoor.openai_logprobs import LogprobTrail
from frontdoor.served_model import ServedModel
from frontdoor.sse import first_delta, send_event
from tandem.status import NotFound, TandemError, status_of

log = logging.getLogger("tandem.http")
_GONE = (ConnectionResetError, ConnectionError)


def add_openai_routes(router, served: ServedModel) -> None:
    api = OpenAIRoutes(served)
    router.add_get("/v1/models", api.models)
    router.add_get("/v1/models/{model}", api.model)
    router.add_post("/v1/completions", api.completions)
    router.add_post("/v1/chat/completions", api.chat)


class OpenAIRoutes:
    def __init__(self, served: ServedModel):
        self.served = served
        self.service = served.service
        self.names = (served.served_name, served.triton_name)
        self.unknown = UnknownFields()

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._card()]})

    def _card(self) -> dict:
        return {"id": self.served.served_name, "object": "model", "created": 0, "owned_by": "tandem"}

    async def model(self, request):
        name = request.match_info["model"]
        if name not in self.names:
            raise NotFound(f"the model {name!r} does not exist; this server serves {self.served.served_name!r}")
        return web.json_response(self._card())

    async def completions(self, request):
        self.service.refuse_if_closed()
        body = await read_object(request)
        rid = oa.new_id("cmpl")
        req, stream = oa.completion_request(body, self.names, rid, self.unknown)
        return await self._answer(request, req, stream, rid, oa.completion_body, body)

    async def chat(self, request):
        self.service.refuse_if_closed()
        body = await read_object(request)
        rid = oa.new_id("chatcmpl")
        req, stream = oa.chat_request(body, self.names, rid, self.unknown)
        return await self._answer(request, req, stream, rid, oa.chat_body, body)

    async def _answer(self, request, req, stream: bool, rid: str, shape, body: dict):
        prep = await self.service.prepare(dataclasses.replace(req, timeout_s=request_timeout(request)))
        n_in = len(prep.prompt_ids)
        trail = self._trail(prep, shape) if req.logprobs else None
        echo = self._echo(prep)
        if not stream:
            text, n, reason, cached = await self._collect(prep, trail)
            return web.json_response(shape(rid, self.served.served_name, echo + text, reason,
                                           oa.usage(n_in, n, cached), chunk=False,
                                           logprobs=trail.take() if trail else None))
        async with contextlib.aclosing(self.service.stream(prep)) as deltas:
            first = await first_delta(deltas)  # a refusal (429, 503, ...) is still an HTTP status, not an SSE event
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            n = await self._events(resp, rid, shape, body, n_in, _chain(first, deltas), trail, echo)
        if n is not None:
            with contextlib.suppress(*_GONE):
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
        return resp

    def _trail(self, prep, shape) -> LogprobTrail:
        tok = self.service.tokenizer
        return LogprobTrail(shape is oa.chat_body, lambda t: tok.decode([t], skip_special_tokens=False),
                            list(prep.prompt_ids) if prep.params.prompt_logprobs else None)

    def _echo(self, prep) -> str:
        """The prompt text repeated before the answer (completions' echo), else ""."""
        req = prep.request
        if req.exclude_input:
            return ""
        return req.prompt if req.prompt is not None else self.service.tokenizer.decode(prep.prompt_ids)

    async def _collect(self, prep, trail: LogprobTrail | None) -> tuple[str, int, str | None, int]:
        """The whole answer: (text, tokens, finish reason, prompt tokens served from a prefix cache)."""
        text, n, reason, cached = [], 0, None, 0
        async with contextlib.aclosing(self.service.stream(prep)) as deltas:  # a cancel cleans up at once
            async for d in deltas:
                if trail:
                    trail.add(d)
                text.append(d.text)
                n += d.token is not None
                reason, cached = d.finish_reason or reason, cached or d.cached_tokens
        return "".join(text), n, reason, cached

    async def _events(self, resp, rid: str, shape, body: dict, n_in: int, deltas, trail: LogprobTrail | None,
                      echo: str) -> int | None:
        """Write the SSE events; the number of tokens, or None when the client went away. A token whose
        text is held back (a partial character, a possible stop string) has its logprobs sent with the
        next event that carries text."""
        name = self.served.served_name
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        n, is_first, cached = 0, True, 0
        try:
            async for d in deltas:
                n += d.token is not None
                cached = cached or d.cached_tokens
                if trail:
                    trail.add(d)
                if not d.text and not d.finish_reason:
                    continue
                extra = {"first": is_first} if shape is oa.chat_body else {}
                text = echo + d.text if is_first else d.text
                await send_event(resp, shape(rid, name, text, d.finish_reason, None, chunk=True,
                                             logprobs=trail.take() if trail else None, **extra))
                is_first = False
            if include_usage:
                chunk = shape(rid, name, "", None, oa.usage(n_in, n, cached), chunk=True)
                chunk["choices"] = []
                await send_event(resp, chunk)
        except TandemError as e:
            with contextlib.suppress(*_GONE):
                await send_event(resp, oa.error_body(str(e), kind="server_error") | {"status": status_of(e).value})
        except _GONE:
            log.debug("client of %s disconnected after %d tokens; request cancelled", rid, n)
            return None
        return n


async def _chain(first, rest):
    if first is not None:
        yield first
    async for d in rest:
        yield d
