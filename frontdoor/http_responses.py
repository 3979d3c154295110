"""POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel: OpenAI's
Responses API over the chat door.

A request is read into the chat it amounts to (openai_responses.py: after the conversation of its
`previous_response_id`, when the server keeps responses: response_store.py), served by the core like
that chat, and the chat reply it would have had (text, tool calls, reasoning: reasoning_text.chat_shape)
is reshaped into the response's items (responses_shape.py), whole or as
Responses events. A response made with `store` (the default) on a server that keeps responses is
kept for its caller; GET reads it back, DELETE drops it. One made with `background` is answered after
the reply (response_background.py), and cancel ends it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable

from aiohttp import web

from frontdoor import openai_api as oa
from frontdoor import openai_responses as rs
from frontdoor import response_background
from frontdoor.core import Answer, FrontDoor
from frontdoor.http_body import read_object, request_timeout
from frontdoor.http_openai import GONE, count, event_stream
from frontdoor.openai_fields import UnknownFields
from frontdoor.openai_tokens import TokenTrail, trail_of, watching
from frontdoor.reasoning_text import ReasoningShape, chat_shape
from frontdoor.response_store import Kept, ResponseStore
from frontdoor.responses_shape import Shaper
from tandem.request_context import api_key_name
from tandem.status import Internal, InvalidArgument, TandemError, status_of

log = logging.getLogger("tandem.http")


def add_responses_routes(router, door: FrontDoor, store: ResponseStore) -> None:
    api = ResponsesRoutes(door, store, UnknownFields())
    router.add_post("/v1/responses", api.create)
    router.add_get("/v1/responses/{id}", api.read)
    router.add_delete("/v1/responses/{id}", api.delete)
    router.add_post("/v1/responses/{id}/cancel", api.cancel)


class ResponsesRoutes:
    def __init__(self, door: FrontDoor, store: ResponseStore, unknown: UnknownFields):
        self.door, self.store, self.unknown = door, store, unknown
        self.served = door.served
        self.names = (self.served.served_name, self.served.triton_name)

    async def read(self, request):
        return web.json_response(self.store.get(request.match_info["id"], api_key_name()).response)

    async def delete(self, request):
        rid = request.match_info["id"]
        self.store.delete(rid, api_key_name())
        return web.json_response({"id": rid, "object": "response", "deleted": True})

    async def cancel(self, request):
        return web.json_response(await response_background.cancel(self.store, request.match_info["id"],
                                                                   api_key_name()))

    async def create(self, request):
        self.door.service.refuse_if_closed()
        body = await read_object(request)
        with rs.named_as_responses():
            earlier = self._earlier(body.get("previous_response_id"))
            chat, extra = rs.chat_request_of(body, earlier)
            if extra:
                self.unknown.note(extra, "/v1/responses")
            rid = oa.new_id("resp")
            parsed = oa.chat_request(chat, self.names, rid, self.unknown, self.served.tool_call_parser)
            keep = bool(self.store.capacity) and body.get("store") is not False
            background = rs.in_background(body, keep)
            shape = chat_shape(parsed, self.served.reasoning_parser)
            reqs = [dataclasses.replace(r, timeout_s=request_timeout(request)) for r in parsed.answers]
            trail = trail_of(reqs[0], True, parsed.shown, self.door.service.tokenizer)  # None: no logprobs
            thinks = isinstance(shape, ReasoningShape)
            if trail and thinks:
                raise InvalidArgument(f"include: {rs.LOGPROBS} is not served where answers are split into reasoning "
                                      f"and text (this server's reasoning parser)", "include")
            shaper = Shaper(body, rid, self.served.served_name, calls=parsed.tools is not None, stored=keep,
                            reasoning_parser=self.served.reasoning_parser if thinks else None)
            watch = watching(shaper.see, trail.add if trail else None)  # each delta: reasoning tokens, logprobs
            owner, asked = api_key_name(), rs.asked(chat, body)

            def ended(answers: list[Answer]) -> Kept:
                """The kept response of the whole answer (the chat reply it would have had, reshaped)."""
                a = answers[0]
                use = oa.usage(a.prompt_tokens, a.tokens, a.cached_tokens)
                choice = shape(rid, shaper.model, a.text, a.finish_reason, use, chunk=False)["choices"][0]
                message = choice["message"]
                done = shaper.whole(message["content"], message.get("tool_calls") or [], choice["finish_reason"], use,
                                    _logprobs(trail), message.get("reasoning"))
                return Kept(owner, (*asked, shaper.answer()), done)

            if background:
                def answer(on_delta):
                    return self.door.collect_all(reqs, [watching(on_delta, watch)])
                return web.json_response(await response_background.start(
                    self.store, rid, owner, answer, ended, shaper.response(None, None, done=False)))
            if not parsed.stream:
                done = ended(await self.door.collect_all(reqs, [watch])).response
            else:
                events = _ResponseEvents(request, shaper, shape, trail, watch)
                async with contextlib.aclosing(self.door.answer_all(reqs)) as deltas:
                    done = await events.send(deltas)
        if keep and done is not None:
            self.store.put(rid, Kept(owner, (*asked, shaper.answer()), done))
        if not parsed.stream:
            return web.json_response(done)
        if events.resp is None:
            raise Internal(f"the answer of {rid} ended before its first delta")
        return events.resp

    def _earlier(self, previous) -> tuple[dict, ...]:
        """The conversation a follow-up continues: its previous response's, or none."""
        if previous is None:
            return ()
        if not isinstance(previous, str):
            raise InvalidArgument(f"previous_response_id must be a response's id (a string), got {previous!r:.80}",
                                  "previous_response_id")
        kept = self.store.get(previous, api_key_name(), "previous_response_id")
        status = kept.response["status"]
        if status not in ("completed", "incomplete"):  # a background one still answered, failed or cancelled
            raise InvalidArgument(f"previous_response_id: response {previous} is {status}; only a completed or "
                                  f"incomplete response can be continued", "previous_response_id")
        return kept.conversation


class _ResponseEvents:
    """One Responses API stream: its opening events with the first delta (so a refusal before it is
    still an HTTP status), then each piece of the chat reply's stream (`shape`: its text, its calls) as
    Responses events, then the closing ones; a failure after the start is an `error` event. A client
    that leaves cancels the request."""

    def __init__(self, request, shaper: Shaper, shape, trail: TokenTrail | None, watch: Callable):
        """`trail`: the answer's logprobs, if asked for; `watch` sees each delta first (trail.add among others)."""
        self.request, self.shaper, self.shape, self.trail, self.watch = request, shaper, shape, trail, watch
        self.resp: web.StreamResponse | None = None

    async def send(self, deltas) -> dict | None:
        """Write the events; the whole response once it ended well, else None."""
        reason, seen = None, [0, 0, 0]  # prompt, completion and cached tokens
        try:
            async for d in deltas:
                if self.resp is None:
                    self.resp = await event_stream(self.request)
                    await self._sse(self.shaper.opening())
                count(seen, d)
                self.watch(d)
                if not d.text and not d.finish_reason:
                    continue
                chunk = self.shape(self.shaper.id, self.shaper.model, d.text, d.finish_reason, None, chunk=True)
                if chunk is not None:  # None: held (what may be a tool call)
                    reason = chunk["choices"][0]["finish_reason"] or reason
                    await self._sse(self._events(chunk["choices"][0]["delta"]))
            closing = self.shaper.closing(reason, oa.usage(*seen), _logprobs(self.trail))
            await self._sse(closing)
            return closing[-1]["response"]
        except TandemError as e:
            if self.resp is None:
                raise
            with contextlib.suppress(*GONE):
                await self._sse([self.shaper.event("error", code=status_of(e).value, message=str(e), param=None)])
        except GONE:
            log.debug("client of %s disconnected after %d tokens; request cancelled", self.shaper.id, seen[1])
        return None

    def _events(self, delta: dict) -> list[dict]:
        """A chat chunk's delta as Responses events: its reasoning, its text, then its calls (new ones, or
        pieces of one)."""
        events = self.shaper.reasoning(delta["reasoning"]) if delta.get("reasoning") else []
        if delta.get("content"):
            events += self.shaper.text(delta["content"], _logprobs(self.trail))
        for call in delta.get("tool_calls") or ():
            fn = call["function"]
            events += self.shaper.call(call["id"], fn["name"], fn.get("arguments") or "") if call.get("id") \
                else self.shaper.arguments(fn.get("arguments") or "")
        return events

    async def _sse(self, events: list[dict]) -> None:
        for obj in events:
            await self.resp.write(f"event: {obj['type']}\ndata: ".encode() + json.dumps(obj).encode() + b"\n\n")


def _logprobs(trail: TokenTrail | None) -> list[dict]:
    """The logprobs entries of the answer's tokens since the last take (none where none were asked)."""
    return trail.take()["content"] if trail else []
