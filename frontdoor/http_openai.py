"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (SSE when streaming).

The model id is the served model's name (ServedModel.served_name); its Triton name is an alias. A
client that disconnects mid-stream cancels its request (one debug line, no traceback); a failure
after the stream began is sent as a last SSE event carrying the status, then [DONE].
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging

from aiohttp import web

from frontdoor import openai_api as oa
from frontdoor.http_body import read_object, request_timeout
from frontdoor.served_model import ServedModel
from tandem.status import TandemError, status_of

log = logging.getLogger("tandem.http")
_GONE = (ConnectionResetError, ConnectionError)


def add_openai_routes(router, served: ServedModel) -> None:
    api = OpenAIRoutes(served)
    router.add_get("/v1/models", api.models)
    router.add_post("/v1/completions", api.completions)
    router.add_post("/v1/chat/completions", api.chat)


class OpenAIRoutes:
    def __init__(self, served: ServedModel):
        self.served = served
        self.service = served.service
        self.names = (served.served_name, served.triton_name)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.served.served_name, "object": "model",
                                                              "created": 0, "owned_by": "tandem"}]})

    async def completions(self, request):
        self.service.refuse_if_closed()
        body = await read_object(request)
        rid = oa.new_id("cmpl")
        req, stream = oa.completion_request(body, self.names, rid)
        return await self._answer(request, req, stream, rid, oa.completion_body, body)

    async def chat(self, request):
        self.service.refuse_if_closed()
        body = await read_object(request)
        rid = oa.new_id("chatcmpl")
        req, stream = oa.chat_request(body, self.names, rid)
        return await self._answer(request, req, stream, rid, oa.chat_body, body)

    async def _answer(self, request, req, stream: bool, rid: str, shape, body: dict):
        prep = await self.service.prepare(dataclasses.replace(req, timeout_s=request_timeout(request)))
        n_in = len(prep.prompt_ids)
        if not stream:
            text, n, reason, cached = await self._collect(prep)
            return web.json_response(shape(rid, self.served.served_name, text, reason, oa.usage(n_in, n, cached),
                                           chunk=False))
        async with contextlib.aclosing(self.service.stream(prep)) as deltas:
            first = await _first(deltas)  # a refusal (429, 503, ...) is still an HTTP status, not an SSE event
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            n = await self._events(resp, rid, shape, body, n_in, _chain(first, deltas))
        if n is not None:
            with contextlib.suppress(*_GONE):
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
        return resp

    async def _collect(self, prep) -> tuple[str, int, str | None, int]:
        """The whole answer: (text, tokens, finish reason, prompt tokens served from a prefix cache)."""
        text, n, reason, cached = [], 0, None, 0
        async with contextlib.aclosing(self.service.stream(prep)) as deltas:  # a cancel cleans up at once
            async for d in deltas:
                text.append(d.text)
                n += d.token is not None
                reason, cached = d.finish_reason or reason, cached or d.cached_tokens
        return "".join(text), n, reason, cached

    async def _events(self, resp, rid: str, shape, body: dict, n_in: int, deltas) -> int | None:
        """Write the SSE events; the number of tokens, or None when the client went away."""
        name = self.served.served_name
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        n, is_first, cached = 0, True, 0
        try:
            async for d in deltas:
                n += d.token is not None
                cached = cached or d.cached_tokens
                if not d.text and not d.finish_reason:
                    continue
                extra = {"first": is_first} if shape is oa.chat_body else {}
                await _sse(resp, shape(rid, name, d.text, d.finish_reason, None, chunk=True, **extra))
                is_first = False
            if include_usage:
                chunk = shape(rid, name, "", None, oa.usage(n_in, n, cached), chunk=True)
                chunk["choices"] = []
                await _sse(resp, chunk)
        except TandemError as e:
            with contextlib.suppress(*_GONE):
                await _sse(resp, oa.error_body(str(e), kind="server_error") | {"status": status_of(e).value})
        except _GONE:
            log.debug("client of %s disconnected after %d tokens; request cancelled", rid, n)
            return None
        return n

async def _first(deltas):
    """The first delta (None if the stream is empty); raises the request's error before any byte is sent."""
    try:
        return await deltas.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first, rest):
    if first is not None:
        yield first
    async for d in rest:
        yield d


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
