"""The responses /v1/responses keeps, for `previous_response_id` and GET / DELETE /v1/responses/{id}.

A deployment keeps the last `front_door.responses_kept` responses made with `store` (the API's default:
true) in the front door's memory; 0, the default, keeps none (every response then says `"store":
false`, and `previous_response_id` is a 400). The oldest goes first when one more is kept; a restart
forgets them all. Each is its owner's: the name of the API key that made it (frontdoor/api_keys.py: a
holder's keys share their responses), "" without keys. Another caller's, a dropped and a never-kept
id are one and the same 404, so nobody learns which ids exist.

A kept response holds the conversation that a follow-up continues: the chat messages it was asked
(its instructions aside: they do not carry over, as in OpenAI's API) and its answer as the assistant's
message (text and tool calls).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tandem.status import InvalidArgument, NotFound


@dataclass(frozen=True)
class Kept:
    owner: str  # the API key's name ("" without keys)
    conversation: tuple[dict, ...]  # chat messages: what it was asked (no instructions) and its answer
    response: dict  # the response object as it was returned


class ResponseStore:
    def __init__(self, capacity: int):
        """`capacity`: how many responses are kept (0: none)."""
        self.capacity = capacity
        self._kept: OrderedDict[str, Kept] = OrderedDict()

    def put(self, rid: str, kept: Kept) -> None:
        self._kept[rid] = kept
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

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

    def delete(self, rid: str, owner: str) -> None:
        self.get(rid, owner)
        del self._kept[rid]
