"""The responses /v1/responses keeps, for `previous_response_id` and GET / DELETE /v1/responses/{id}.

A deployment keeps the last `front_door.responses_kept` responses made with `store` (the API's default:
true) in the front door's memory, at most `front_door.responses_kept_bytes` of them (as JSON); 0, the
default, keeps none (every response then says `"store": false`, and `previous_response_id` is a 400).
The oldest goes first when one more is kept, or when they grew past the bytes (a background response is
counted when it is kept and again when it ends); a restart forgets them all. Each is its owner's: the
name of the API key that made it (frontdoor/api_keys.py: a holder's keys share their responses), ""
without keys. Another caller's, a dropped and a never-kept id are one and the same 404, so nobody
learns which ids exist.

A kept response holds the conversation that a follow-up continues: the chat messages it was asked
(its instructions aside: they do not carry over, as in OpenAI's API) and its answer as the assistant's
message (text and tool calls). A background response (frontdoor/response_background.py) is kept while
its answer is made, with the task making it: dropping it (DELETE, or as the oldest) cancels that task,
and so does `close` (the front door's stop); `settle` puts its end in its place. One made with `stream`
keeps its events too, for readers who follow it (frontdoor/response_events.EventFeed). Each keeps its
input items as the Responses API lists them (frontdoor/response_items.py).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass

from frontdoor.response_events import EventFeed
from tandem.status import InvalidArgument, NotFound

DEFAULT_MAX_BYTES = 256 << 20  # front_door.responses_kept_bytes


@dataclass(frozen=True)
class Kept:
    owner: str  # the API key's name ("" without keys)
    conversation: tuple[dict, ...]  # chat messages: what it was asked (no instructions) and its answer
    response: dict  # the response object as it was returned (a background one: as it is now)
    running: asyncio.Task | None = None  # a background response's answer, while it is made
    feed: EventFeed | None = None  # a background response made with stream: its events (response_events.py)
    items: tuple[dict, ...] = ()  # its input items, as GET .../input_items lists them (response_items.py)


class ResponseStore:
    def __init__(self, capacity: int, max_bytes: int = DEFAULT_MAX_BYTES):
        """`capacity`: how many responses are kept (0: none); `max_bytes`: their size at most, as JSON (a
        streamed background response's events included), though the newest is always kept."""
        self.capacity, self.max_bytes = capacity, max_bytes
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.bytes = 0  # the kept responses' size

    def put(self, rid: str, kept: Kept) -> None:
        self._place(rid, kept)
        self._trim()

    def settle(self, rid: str, task: asyncio.Task, kept: Kept) -> None:
        """Background response `rid` ended (its answer was `task`): `kept` takes its place, if it is still
        kept (not deleted, nor dropped as the oldest)."""
        now = self._kept.get(rid)
        if now is not None and now.running is task:
            self._place(rid, kept)
            self._trim()

    def get(self, rid: str, owner: str, param: str | None = None) -> Kept:
        """The response `rid` of `owner`; NotFound (naming `param`, the request field that gave the id, if
        one did) when there is none to it; InvalidArgument for such a field when none are kept."""
        if not self.capacity:
            why = "responses are not kept by this server (front_door.responses_kept is 0)"
            if param is None:  # GET or DELETE of an id: there is none
                raise NotFound(why)
            raise InvalidArgument(f"{param}: {why}, so none can be continued; send the whole conversation as "
                                  f"input", param)
        kept = self._kept.get(rid)
        if kept is None or kept.owner != owner:
            raise NotFound(f"no response {rid[:80]!r} is kept for this caller (never stored, dropped as "
                           f"older than the last {self.capacity}, deleted, or another API key's)", param)
        return kept

    def item(self, item_id: str, owner: str) -> dict | None:
        """The input or output item `item_id` of one of `owner`'s kept responses (the newest holding it),
        or None: what an `item_reference` names. A scan of the owner's responses, newest first."""
        for kept in reversed(self._kept.values()):
            if kept.owner == owner:
                for item in (*kept.response.get("output", ()), *kept.items):
                    if item.get("id") == item_id:
                        return item
        return None

    def delete(self, rid: str, owner: str) -> None:
        _stop(self.get(rid, owner))
        del self._kept[rid]
        self.bytes -= self._sizes.pop(rid)

    def _place(self, rid: str, kept: Kept) -> None:
        """Keep `kept` as `rid` (the newest when it is new) and count its size."""
        self._kept[rid] = kept
        size = len(json.dumps(kept.response)) + len(json.dumps(kept.conversation)) + len(json.dumps(kept.items))
        size += kept.feed.bytes if kept.feed else 0
        self.bytes += size - self._sizes.get(rid, 0)
        self._sizes[rid] = size

    def _trim(self) -> None:
        """Drop the oldest (cancelling what still runs) while more, or more bytes, are kept than allowed."""
        while len(self._kept) > self.capacity or (self.bytes > self.max_bytes and len(self._kept) > 1):
            rid, kept = self._kept.popitem(last=False)
            self.bytes -= self._sizes.pop(rid)
            _stop(kept)

    async def close(self) -> None:
        """Cancel the background answers still being made, and wait for them to end."""
        running = [k.running for k in self._kept.values() if k.running is not None]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)


def _stop(kept: Kept) -> None:
    if kept.running is not None:
        kept.running.cancel()
