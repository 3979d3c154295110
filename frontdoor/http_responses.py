"""POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel, GET
/v1/responses/{id}/input_items: OpenAI's Responses API over the chat door.

A request is read into the chat it amounts to (openai_responses.py: after the conversation of its
`previous_response_id`, when the server keeps responses: response_store.py), served by the core like
that chat, and the chat reply it would have had (text, tool calls, reasoning: reasoning_text.chat_shape)
is reshaped into the response's items (responses_shape.py), whole or as Responses events. A response
made with `store` (the default) on a server that keeps responses is kept for its caller; GET reads it
back (and its input items: response_items.py), DELETE drops it, and a later request's `item_reference`
input items name its items. One made with `background` is answered
after the reply (response_background.py), and cancel ends it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable

from aiohttp import web

from frontdoor import openai_api as oa
from frontdoor import openai_responses as rs
from frontdoor import response_background, response_items
from frontdoor.core import Answer, FrontDoor
from frontdoor.http_body import read_object, request_timeout
from frontdoor.http_openai import GONE, event_stream, typed_events
from frontdoor.openai_fields import UnknownFields
from frontdoor.openai_tokens import trail_of, watching
from frontdoor.reasoning_text import ReasoningShape, chat_shape
from frontdoor.response_events import AnswerEvents, EventFeed, logprobs
from frontdoor.response_store import Kept, ResponseStore
from frontdoor.responses_shape import Shaper
from tandem.request_context import api_key_name
from tandem.status import Internal, InvalidArgument, TandemError

log = logging.getLogger("tandem.http")


def add_responses_routes(router, door: FrontDoor, store: ResponseStore) -> None:
    api = ResponsesRoutes(door, store, UnknownFields())
    router.add_post("/v1/responses", api.create)
    router.add_get("/v1/responses/{id}", api.read)
    router.add_delete("/v1/responses/{id}", api.delete)
    router.add_post("/v1/responses/{id}/cancel", api.cancel)
    router.add_get("/v1/responses/{id}/input_items", api.input_items)


class ResponsesRoutes:
    def __init__(self, door: FrontDoor, store: ResponseStore, unknown: UnknownFields):
        self.door, self.store, self.unknown = door, store, unknown
        self.served = door.served

    async def read(self, request):
        """The response as it is now; with `?stream=true` a streamed background response's events after
        `starting_after` (default: all), followed until it ends."""
        rid = request.match_info["id"]
        kept = self.store.get(rid, api_key_name())
        after = _starting_after(request.query)
        if after is None:
            return web.json_response(kept.response)
        if kept.feed is None:
            raise InvalidArgument(f"stream: response {rid} was not streamed in the background (made with background "
                                  f"and stream true), so it has no events to read again; read it without stream",
                                  "stream")
        return await _follow(request, kept.feed, after)

    async def input_items(self, request):
        kept = self.store.get(request.match_info["id"], api_key_name())
        return web.json_response(response_items.page(kept.items, request.query))

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
        rs.refuse_state_elsewhere(body)
        body = self._referenced(body)
        with rs.named_as_responses():
            earlier = self._earlier(body.get("previous_response_id"))
            chat, extra = rs.chat_request_of(body, earlier.conversation if earlier else ())
            items = response_items.of_input(body["input"], (*earlier.items, *earlier.response["output"])
                                            if earlier else ())
            if extra:
                self.unknown.note(extra, "/v1/responses")
            rid = oa.new_id("resp")
            parsed = oa.chat_request(chat, self.served.openai_names, rid, self.unknown, self.served.tool_call_parser,
                                     self.served.sampling_defaults)
            keep = bool(self.store.capacity) and body.get("store") is not False
            background = rs.in_background(body, keep)
            shape = chat_shape(parsed, self.served.reasoning_parser)
            reqs = [dataclasses.replace(r, timeout_s=request_timeout(request), drop_oldest_turns=rs.truncated(body))
                    for r in parsed.answers]
            trail = trail_of(reqs[0], True, parsed.shown, self.door.service.tokenizer)  # None: no logprobs
            thinks = isinstance(shape, ReasoningShape)
            if trail and thinks:
                raise InvalidArgument(f"include: {rs.LOGPROBS} is not served where answers are split into reasoning "
                                      f"and text (this server's reasoning parser)", "include")
            shaper = Shaper(body, rid, self.served.answered_as(body.get("model")), calls=parsed.tools is not None,
                            stored=keep, reasoning_parser=self.served.reasoning_parser if thinks else None)
            watch = watching(shaper.see, trail.add if trail else None)  # each delta: reasoning tokens, logprobs
            owner, asked = api_key_name(), rs.asked(chat, body)

            def kept(done: dict) -> Kept:
                """Response `done` as it is kept, with the conversation a follow-up continues."""
                return Kept(owner, (*asked, shaper.answer()), done, items=items)

            def ended(answers: list[Answer]) -> Kept:
                """The kept response of the whole answer (the chat reply it would have had, reshaped)."""
                a = answers[0]
                use = oa.usage(a.prompt_tokens, a.tokens, a.cached_tokens)
                choice = shape(rid, shaper.model, a.text, a.finish_reason, use, chunk=False)["choices"][0]
                message = choice["message"]
                done = shaper.whole(message["content"], message.get("tool_calls") or [], choice["finish_reason"], use,
                                    logprobs(trail), message.get("reasoning"))
                return kept(done)

            events = AnswerEvents(shaper, shape, trail, watch)
            if background:
                feed = EventFeed() if parsed.stream else None
                running = Kept(owner, (), shaper.response(None, None, done=False), feed=feed, items=items)
                reply = await response_background.start(self.store, rid, running,
                                                        self._background(reqs, events, feed, watch),
                                                        ended if feed is None else kept)
                return web.json_response(reply) if feed is None else await _follow(request, feed, -1)
            if not parsed.stream:
                done = ended(await self.door.collect_all(reqs, [watch])).response
            else:
                sent = _ResponseEvents(request, events)
                async with contextlib.aclosing(self.door.answer_all(reqs)) as deltas:
                    done = await sent.send(deltas)
        if keep and done is not None:
            self.store.put(rid, kept(done))
        if not parsed.stream:
            return web.json_response(done)
        if sent.resp is None:
            raise Internal(f"the answer of {rid} ended before its first delta")
        return sent.resp

    def _background(self, reqs: list, events: AnswerEvents, feed: EventFeed | None, watch: Callable):
        """A background answer: `answer(on_delta)` of response_background.start. It returns the chat
        answers, or, streamed (`feed`), adds each delta's events to the feed and returns the whole response."""
        if feed is None:
            return lambda on_delta: self.door.collect_all(reqs, [watching(on_delta, watch)])

        async def streamed(on_delta) -> dict:
            feed.add(events.opening())
            async with contextlib.aclosing(self.door.answer_all(reqs)) as deltas:
                async for d in deltas:
                    on_delta(d)
                    feed.add(events.of(d))
            closing = events.closing()
            feed.add(closing)
            return closing[-1]["response"]
        return streamed

    def _referenced(self, body: dict) -> dict:
        """`body` with each `item_reference` input item replaced by the item of a kept response it names
        (the caller's own: response_store.ResponseStore.item); a 400 naming `input` where it names none."""
        given = body.get("input")
        if not isinstance(given, list) or not any(rs.is_reference(i) for i in given):
            return body
        if not self.store.capacity:
            raise InvalidArgument("input: an item_reference names an item of a kept response, and this server keeps "
                                  "none (tandem serve --responses-kept N); send the item itself", "input")
        items = []
        for i, item in enumerate(given):
            if rs.is_reference(item):
                rid = item.get("id")
                item = self.store.item(rid, api_key_name()) if isinstance(rid, str) else None
                if item is None:
                    raise InvalidArgument(f"input[{i}]: item_reference {rid!r:.80} names no item of this caller's "
                                          f"kept responses", "input")
            items.append(item)
        return body | {"input": items}

    def _earlier(self, previous) -> Kept | None:
        """The kept response a follow-up continues (its conversation and input items), or None."""
        if previous is None:
            return None
        if not isinstance(previous, str):
            raise InvalidArgument(f"previous_response_id must be a response's id (a string), got {previous!r:.80}",
                                  "previous_response_id")
        kept = self.store.get(previous, api_key_name(), "previous_response_id")
        status = kept.response["status"]
        if status not in ("completed", "incomplete"):  # a background one still answered, failed or cancelled
            raise InvalidArgument(f"previous_response_id: response {previous} is {status}; only a completed or "
                                  f"incomplete response can be continued", "previous_response_id")
        return kept


class _ResponseEvents:
    """One foreground Responses API stream: its opening events with the first delta (so a refusal before
    it is still an HTTP status), then each delta's events, then the closing ones; a failure after the
    start is an `error` event. A client that leaves cancels the request."""

    def __init__(self, request, events: AnswerEvents):
        self.request, self.events = request, events
        self.resp: web.StreamResponse | None = None

    async def send(self, deltas) -> dict | None:
        """Write the events; the whole response once it ended well, else None."""
        try:
            async for d in deltas:
                if self.resp is None:
                    self.resp = await event_stream(self.request)
                    await typed_events(self.resp, self.events.opening())
                await typed_events(self.resp, self.events.of(d))
            closing = self.events.closing()
            await typed_events(self.resp, closing)
            return closing[-1]["response"]
        except TandemError as e:
            if self.resp is None:
                raise
            with contextlib.suppress(*GONE):
                await typed_events(self.resp, [self.events.failure(e)])
        except GONE:
            log.debug("client of %s disconnected after %d tokens; request cancelled", self.events.shaper.id,
                      self.events.seen[1])
        return None


async def _follow(request, feed: EventFeed, after: int) -> web.StreamResponse:
    """Stream a background response's events after sequence number `after` until it ends, or the client leaves
    (which changes nothing else)."""
    resp = await event_stream(request)
    with contextlib.suppress(*GONE):
        async for event in feed.follow(after):
            await typed_events(resp, [event])
    return resp


def _starting_after(query) -> int | None:
    """GET's `stream` and `starting_after`: the sequence number to stream after (-1: from the first event),
    or None to read the response whole."""
    stream, after = query.get("stream", "false"), query.get("starting_after")
    if stream not in ("true", "false"):
        raise InvalidArgument(f"stream must be true or false, got {stream!r:.40}", "stream")
    if stream == "false":
        if after is not None:
            raise InvalidArgument("starting_after needs stream=true", "starting_after")
        return None
    if after is None:
        return -1
    if not after.isdigit():
        raise InvalidArgument(f"starting_after must be an event's sequence number (an integer >= 0), got "
                              f"{after!r:.40}", "starting_after")
    return int(after)
