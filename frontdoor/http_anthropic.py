"""POST /v1/messages: Anthropic's Messages API over the chat door (and /v1/messages/count_tokens).

A request is read into the chat it amounts to (anthropic_request.py), served by the core like that
chat, and the chat reply it would have had (text, tool calls, reasoning: reasoning_text.chat_shape) is
reshaped into the message's content blocks (anthropic_shape.py), whole or as Messages events. Keys come
as `x-api-key` (the Anthropic clients' header) or `Authorization: Bearer` (frontdoor/auth.py); errors
are in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`, frontdoor/http_app.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from aiohttp import web

from control.requests import prompt_ids
from frontdoor import anthropic_request as ar
from frontdoor import anthropic_shape as ashape
from frontdoor import openai_api as oa
from frontdoor.core import FrontDoor
from frontdoor.http_body import read_object, request_timeout
from frontdoor.http_openai import GONE, count, event_stream, typed_events
from frontdoor.openai_fields import UnknownFields
from frontdoor.reasoning_text import chat_shape
from tandem.status import Internal, TandemError, status_of

log = logging.getLogger("tandem.http")


def add_anthropic_routes(router, door: FrontDoor) -> None:
    route = MessagesRoute(door)
    router.add_post("/v1/messages", route.create)
    router.add_post("/v1/messages/count_tokens", route.count_tokens)


def error_type(status) -> str:
    """Anthropic's error `type` of a tandem status (its HTTP status table: frontdoor/protocol_status.py)."""
    return _ERRORS.get(status.value, "api_error")


_ERRORS = {"INVALID_ARGUMENT": "invalid_request_error", "TOO_LARGE": "request_too_large",
           "METHOD_NOT_ALLOWED": "invalid_request_error", "NOT_FOUND": "not_found_error",
           "REQUEST_TIMEOUT": "invalid_request_error",
           "UNAUTHENTICATED": "authentication_error", "RESOURCE_EXHAUSTED": "rate_limit_error",
           "OUT_OF_PAGES": "rate_limit_error", "UNAVAILABLE": "overloaded_error"}


class MessagesRoute:
    def __init__(self, door: FrontDoor):
        self.door, self.served = door, door.served
        self.unknown = UnknownFields()

    async def create(self, request):
        self.door.service.refuse_if_closed()
        body = await read_object(request)
        with ar.named_as_messages():
            chat, extra = ar.chat_request_of(body)
            if extra:
                self.unknown.note(extra, "/v1/messages")
            mid = ashape.new_id()
            parsed = oa.chat_request(chat, self.served.openai_names, mid, self.unknown, self.served.tool_call_parser,
                                     self.served.sampling_defaults)
            shape = chat_shape(parsed, self.served.reasoning_parser)
            reqs = [dataclasses.replace(r, timeout_s=request_timeout(request)) for r in parsed.answers]
            model = self.served.answered_as(body.get("model"))
            if not parsed.stream:
                [a] = await self.door.collect_all(reqs)
                use = oa.usage(a.prompt_tokens, a.tokens, a.cached_tokens)
                reply = shape(mid, model, a.text, a.finish_reason, use, chunk=False)["choices"][0]
                return web.json_response(ashape.message(mid, model, ashape.blocks(reply["message"]),
                                                        reply["finish_reason"], ashape.usage(use), a.stop_reason))
            stream = _Stream(request, ashape.MessageEvents(mid, model), shape)
            async with contextlib.aclosing(self.door.answer_all(reqs)) as deltas:
                await stream.send(deltas)
        if stream.resp is None:
            raise Internal(f"the answer of {mid} ended before its first delta")
        return stream.resp

    async def count_tokens(self, request):
        """{"input_tokens": n}: the prompt tokens POST /v1/messages would be asked with these messages,
        system and tools (its `usage.input_tokens`), counted by the same template off the event loop
        under admission; nothing is generated and no context limit applies to the count."""
        svc = self.door.service
        svc.refuse_if_closed()
        body = await read_object(request)
        with ar.named_as_messages():
            chat, extra = ar.count_request_of(body)
            if extra:
                self.unknown.note(extra, "/v1/messages/count_tokens")
            parsed = oa.chat_request(chat, self.served.openai_names, ashape.new_id(), self.unknown,
                                     self.served.tool_call_parser, self.served.sampling_defaults)
            ids = await svc.off_loop(prompt_ids, parsed.answers[0], svc.tokenizer, svc.limits)
        return web.json_response({"input_tokens": len(ids)})


class _Stream:
    """One streamed message: `message_start` with the first delta (so a refusal before it is still an
    HTTP status), each delta's events, then the closing ones; a failure after the start is an `error`
    event. A client that leaves cancels the request."""

    def __init__(self, request, events: ashape.MessageEvents, shape):
        self.request, self.events, self.shape = request, events, shape
        self.resp: web.StreamResponse | None = None
        self.seen = [0, 0, 0]  # prompt, completion and cached tokens
        self.reason = self.stop = None

    async def send(self, deltas) -> None:
        ev = self.events
        try:
            async for d in deltas:
                count(self.seen, d)
                if self.resp is None:
                    self.resp = await event_stream(self.request)
                    await self._sse(ev.start(self.seen[0]))
                self.stop = d.stop_reason or self.stop
                chunk = self.shape(ev.id, ev.model, d.text, d.finish_reason, None, chunk=True) \
                    if d.text or d.finish_reason else None
                if chunk is not None:
                    choice = chunk["choices"][0]
                    self.reason = choice["finish_reason"] or self.reason
                    await self._sse(ev.of(choice["delta"]))
            await self._sse(ev.end(self.reason, self.seen[1], self.stop))
        except TandemError as e:
            if self.resp is None:
                raise
            with contextlib.suppress(*GONE):
                await self._sse([{"type": "error", "error": {"type": error_type(status_of(e)), "message": str(e)}}])
        except GONE:
            log.debug("client of %s disconnected after %d tokens; request cancelled", ev.id, self.seen[1])

    async def _sse(self, events: list[dict]) -> None:
        await typed_events(self.resp, events)
