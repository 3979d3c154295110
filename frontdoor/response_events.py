"""A response's streamed events: made from its chat answer's deltas, and kept for readers who come and go.

`AnswerEvents` turns one chat answer, delta by delta, into the Responses events of responses_shape.py:
the opening ones, each delta's (its reasoning, its text and its calls, as the chat reply's stream shapes
them: frontdoor/reasoning_text.chat_shape), the closing ones. A foreground stream writes them to its
client as they come (frontdoor/http_responses.py).

`EventFeed` keeps every event of a background response made with `stream: true`
(frontdoor/response_background.py), so that any number of readers may follow it from any point: the
POST's own stream from the first event, `GET /v1/responses/{id}?stream=true&starting_after=N` from the
event after sequence number N. Sequence numbers are the events' places in the feed (0, 1, ...). A reader
that leaves changes nothing; the answer goes on. The feed ends with the response's end: after
`response.completed` or `response.incomplete`, with `response.failed` (the failed response, its error
inside) or, for a cancelled one, an `error` event whose code is `CANCELLED`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from frontdoor import openai_api as oa
from frontdoor.http_openai import count
from frontdoor.openai_tokens import TokenTrail
from frontdoor.responses_shape import Shaper
from tandem.status import TandemError, status_of


class AnswerEvents:
    """The Responses events of one chat answer (`shape`: how its deltas read as chat chunks)."""

    def __init__(self, shaper: Shaper, shape, trail: TokenTrail | None, watch: Callable):
        """`trail`: the answer's logprobs, if asked for; `watch` sees each delta first (trail.add among others)."""
        self.shaper, self.shape, self.trail, self.watch = shaper, shape, trail, watch
        self.reason: str | None = None  # the chat's finish reason, once a chunk carried it
        self.seen = [0, 0, 0]  # prompt, completion and cached tokens

    def opening(self) -> list[dict]:
        return self.shaper.opening()

    def of(self, d) -> list[dict]:
        """The events of delta `d` (none while its text is held: what may be a tool call, a partial character)."""
        count(self.seen, d)
        self.watch(d)
        if not d.text and not d.finish_reason:
            return []
        chunk = self.shape(self.shaper.id, self.shaper.model, d.text, d.finish_reason, None, chunk=True)
        if chunk is None:
            return []
        choice = chunk["choices"][0]
        self.reason = choice["finish_reason"] or self.reason
        delta = choice["delta"]
        events = self.shaper.reasoning(delta["reasoning"]) if delta.get("reasoning") else []
        if delta.get("content"):
            events += self.shaper.text(delta["content"], logprobs(self.trail))
        for call in delta.get("tool_calls") or ():
            fn = call["function"]
            events += self.shaper.call(call["id"], fn["name"], fn.get("arguments") or "") if call.get("id") \
                else self.shaper.arguments(fn.get("arguments") or "")
        return events

    def closing(self) -> list[dict]:
        """The events after the last delta; the last one holds the whole response."""
        return self.shaper.closing(self.reason, oa.usage(*self.seen), logprobs(self.trail))

    def failure(self, e: TandemError) -> dict:
        """The `error` event of an answer that failed after its stream began."""
        return self.shaper.event("error", code=status_of(e).value, message=str(e), param=None)


def logprobs(trail: TokenTrail | None) -> list[dict]:
    """The logprobs entries of the answer's tokens since the last take (none where none were asked)."""
    return trail.take()["content"] if trail else []


class EventFeed:
    """Every event of one background stream, in order, until it ends."""

    def __init__(self):
        self.events: list[dict] = []  # events[i]["sequence_number"] == i
        self.ended = False
        self.bytes = 0  # the events' size as JSON (what the response store counts: frontdoor/response_store.py)
        self._more = asyncio.Event()  # set (and replaced) whenever events are added or the feed ends

    def add(self, events: list[dict]) -> None:
        self.events += events
        self.bytes += sum(len(json.dumps(e)) for e in events)
        self._wake()

    def end(self, kind: str | None = None, **fields) -> None:
        """The response ended: with one more event of type `kind` (and `fields`), if given."""
        if kind is not None:
            self.add([{"type": kind, "sequence_number": len(self.events)} | fields])
        self.ended = True
        self._wake()

    async def follow(self, after: int = -1) -> AsyncIterator[dict]:
        """The events after sequence number `after`, those to come included, until the feed ends."""
        i = after + 1
        while True:
            more = self._more
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.ended:
                return
            await more.wait()

    def _wake(self) -> None:
        self._more.set()
        self._more = asyncio.Event()
