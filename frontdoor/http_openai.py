"""The OpenAI-compatible routes: /v1/models[/{id}], /v1/completions, /v1/chat/completions (SSE when
streaming), and SageMaker's /invocations (either of the two, by its body, as vLLM's); /v1/responses is
http_responses.py, over the same chat reading and shaping.

A codec over the front-door core (frontdoor/core.py): parse (openai_api.py), answer or collect, shape
the reply. A request's answers (a batch of prompts, `n` each) are served concurrently
(FrontDoor.answer_all / collect_all) and come back as its choices. The model id is the served model's
name (ServedModel.served_name); its aliases and its Triton name are accepted too. Fields the server
does not know are accepted and named once in the log (openai_fields.py). Logprobs (and an echoed
prompt's) are built token by token (openai_tokens.py). A client that disconnects mid-stream cancels
its request (one debug line, no traceback); a failure after the stream began is sent as a last SSE
event carrying the status, then [DONE].
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from itertools import zip_longest

from aiohttp import web

from frontdoor import openai_api as oa
from frontdoor.core import FrontDoor
from frontdoor.http_body import read_object, request_timeout
from frontdoor.openai_fields import UnknownFields
from frontdoor.openai_tokens import TokenTrail, chunk_extras, trail_of, watching, whole_extras
from frontdoor.reasoning_text import ReasoningShape, chat_shape
from tandem.status import Internal, InvalidArgument, TandemError, status_of

log = logging.getLogger("tandem.http")
GONE = (ConnectionResetError, ConnectionError)  # the client went away


def add_openai_routes(router, door: FrontDoor) -> None:
    api = OpenAIRoutes(door)
    router.add_get("/v1/models", api.models)
    router.add_get("/v1/models/{model}", api.model)
    router.add_post("/v1/completions", api.completions)
    router.add_post("/v1/chat/completions", api.chat)
    router.add_post("/invocations", api.invocations)  # SageMaker's, as vLLM serves it


class OpenAIRoutes:
    def __init__(self, door: FrontDoor):
        self.door, self.served = door, door.served
        self.service = door.service
        self.unknown = UnknownFields()

    async def models(self, request):
        """One card per OpenAI id (the served name, its aliases, then its LoRA adapters), as vLLM lists them."""
        cards = [self._card(n) for n in (*self.served.listed, *self.served.adapters)]
        return web.json_response({"object": "list", "data": cards})

    def _card(self, name: str) -> dict:
        """A model's card; an adapter's names its base model as `parent` (vLLM's)."""
        parent = {"parent": self.served.served_name} if name in self.served.adapters else {}
        return {"id": name, "object": "model", "created": 0, "owned_by": "tandem",
                "max_model_len": self.service.limits.max_context, **parent}  # as vLLM's cards carry it

    async def model(self, request):
        """The card of a name a request may use (the Triton name's is the served name's)."""
        name = request.match_info["model"]
        if name not in self.served.openai_names:
            raise oa.unknown_model(name, self.served.openai_names)
        own = name in self.served.listed or name in self.served.adapters
        return web.json_response(self._card(name if own else self.served.served_name))

    async def completions(self, request):
        self.service.refuse_if_closed()
        body = await read_object(request)
        rid = oa.new_id("cmpl")
        parsed = oa.completion_request(body, self.served.openai_names, rid, self.unknown, self.served.sampling_defaults)
        return await self._answer(request, parsed, rid, oa.completion_body, body, chat=False)

    async def chat(self, request):
        self.service.refuse_if_closed()
        body = await read_object(request)
        rid = oa.new_id("chatcmpl")
        parsed = oa.chat_request(body, self.served.openai_names, rid, self.unknown, self.served.tool_call_parser,
                                 self.served.sampling_defaults)
        return await self._answer(request, parsed, rid, chat_shape(parsed, self.served.reasoning_parser), body,
                                  chat=True)

    async def invocations(self, request):
        """POST /invocations (the route SageMaker sends requests to), as vLLM serves it: a body with
        `messages` is a chat completion, one with `prompt` a completion."""
        body = await read_object(request)  # aiohttp keeps the bytes: the route it goes to reads them again
        if "messages" in body:
            return await self.chat(request)
        if "prompt" in body:
            return await self.completions(request)
        raise InvalidArgument("/invocations takes a chat completion request (with messages) or a completion "
                              "request (with prompt)", "messages")

    async def _answer(self, request, parsed: oa.Parsed, rid: str, shape, body: dict, chat: bool):
        """Every answer the request asks for (its choices), collected into one reply or streamed. `shape`
        makes a reply or an SSE event (None: nothing to send yet)."""
        timeout = request_timeout(request)
        reqs = [dataclasses.replace(r, timeout_s=timeout) for r in parsed.answers]
        trails = [trail_of(r, chat, parsed.shown, self.service.tokenizer) for r in reqs]
        # under a reasoning parser: each answer's reasoning tokens (usage's completion_tokens_details)
        thoughts = [shape.thoughts() for _ in reqs] if isinstance(shape, ReasoningShape) else []
        model = self.served.answered_as(body.get("model"))
        if not parsed.stream:
            answers = await self.door.collect_all(reqs, [watching(t.add if t else None, th.add if th else None)
                                                         for t, th in zip_longest(trails, thoughts)])
            choices = [(a.text, a.finish_reason, t.take() if t else None) for a, t in zip(answers, trails)]
            usage = thought(parsed.usage([(a.prompt_tokens, a.tokens, a.cached_tokens) for a in answers]), thoughts)
            reply = oa.whole_body(shape, rid, model, choices, usage)
            for choice, a in zip(reply["choices"], answers):
                choice["stop_reason"] = a.stop_reason  # vLLM's: the stop string or stop token that ended it
            return web.json_response(whole_extras(reply, trails, parsed.shown, chat))
        events = _Events(request, rid, model, shape, body, trails, parsed, chat, thoughts)
        async with contextlib.aclosing(self.door.answer_all(reqs)) as deltas:
            done = await events.send(deltas)
        if events.resp is None:  # the core yields at least the delta with the finish reason
            raise Internal(f"the answer of {rid} ended before its first delta")
        if done:
            with contextlib.suppress(*GONE):
                await events.resp.write(b"data: [DONE]\n\n")
                await events.resp.write_eof()
        return events.resp


async def event_stream(request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def typed_events(resp: web.StreamResponse, events: list[dict]) -> None:
    """Write each event as a named SSE event (`event: <its type>`, then `data: <it as JSON>`), as the
    Responses and Messages APIs stream (chat completions send bare `data:` lines)."""
    for obj in events:
        await resp.write(f"event: {obj['type']}\ndata: ".encode() + json.dumps(obj).encode() + b"\n\n")


def thought(usage: dict, thoughts: list) -> dict:
    """`usage` with the answers' reasoning tokens, when a reasoning parser counted them (ReasoningShape)."""
    if thoughts:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(t.total() for t in thoughts)}
    return usage


def count(seen: list[int], d) -> None:
    """One choice's prompt, completion and cached tokens, after delta `d`."""
    seen[:] = d.prompt_tokens, seen[1] + (d.token is not None), seen[2] or d.cached_tokens


class _Events:
    """One SSE stream of a request's choices, each delta an event of its choice. The response starts
    with the first delta, so a refusal (429, 503, ...) before it is still an HTTP status, not an SSE
    event. A token whose text is held back (a partial character, a possible stop string) has its
    logprobs sent with the next event of its choice that carries text."""

    def __init__(self, request, rid: str, model: str, shape, body: dict, trails: list[TokenTrail | None],
                 parsed: oa.Parsed, chat: bool, thoughts: list):
        """`thoughts`: each choice's reasoning-token counter (reasoning_text.ThoughtTokens), or none."""
        self.request, self.rid, self.model, self.shape, self.trails = request, rid, model, shape, trails
        self.parsed, self.chat, self.thoughts = parsed, chat, thoughts
        opts = body.get("stream_options") or {}
        self.include_usage = bool(opts.get("include_usage"))
        # vLLM's continuous_usage_stats: every chunk carries its choice's usage so far (reasoning tokens too)
        self.continuous = self.include_usage and bool(opts.get("continuous_usage_stats"))
        self.resp: web.StreamResponse | None = None

    async def send(self, deltas) -> bool:
        """Write the events; False when the client went away (its request is cancelled)."""
        counts = [[0, 0, 0] for _ in self.trails]  # per choice: prompt, completion and cached tokens
        started = [False] * len(self.trails)  # whether the choice has sent an event (chat: its role)
        try:
            async for d in deltas:
                if self.resp is None:
                    self.resp = await event_stream(self.request)
                seen, trail = counts[d.index], self.trails[d.index]
                count(seen, d)
                if trail:
                    trail.add(d)
                if self.thoughts:
                    self.thoughts[d.index].add(d)
                if not d.text and not d.finish_reason:
                    continue
                extra = {"first": not started[d.index]} if self.chat else {}
                so_far = thought(oa.usage(*seen), self.thoughts[d.index:d.index + 1]) if self.continuous else None
                event = self.shape(self.rid, self.model, d.text, d.finish_reason, so_far, chunk=True, index=d.index,
                                   **extra)
                if event is None:  # held (a tool-call list shaped whole at its end): its logprobs wait too
                    continue
                event["choices"][0]["stop_reason"] = d.stop_reason
                if trail:
                    chunk_extras(event, trail, self.parsed.shown, self.chat, first=not started[d.index])
                await self._sse(event)
                started[d.index] = True
            if self.include_usage:
                chunk = self.shape(self.rid, self.model, "", None, thought(self.parsed.usage(counts), self.thoughts),
                                   chunk=True)
                chunk["choices"] = []
                await self._sse(chunk)
        except TandemError as e:
            if self.resp is None:
                raise
            with contextlib.suppress(*GONE):
                await self._sse(oa.error_body(str(e), kind="server_error") | {"status": status_of(e).value})
        except GONE:
            log.debug("client of %s disconnected after %d tokens; request cancelled", self.rid,
                      sum(c[1] for c in counts))
            return False
        return True

    async def _sse(self, obj: dict) -> None:
        await self.resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
