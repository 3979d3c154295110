"""A kept response's input items (GET /v1/responses/{id}/input_items, the SDK's
`responses.input_items.list`): the conversation it was asked, as Responses API items, a page at a time.

A response's input items are those of the response it continued (`previous_response_id`), then that
response's output items, then its own `input` (a string is one user message); its `instructions` are
not among them (they do not carry over). Each item has an `id`: the client's where it gave one, else one
made here (`msg_`, `fc_`, `fco_`, `rs_`), kept with the response so that pages are stable. Messages show
their content as parts (`input_text`; an assistant's `output_text`), as OpenAI's API lists them.

A page is chosen as OpenAI's list calls choose: `order` (`desc`, the default: the newest item first, or
`asc`), `after` (an item's id: the items after it in that order), `limit` (1..100, default 20); the
list says `has_more` where items are left after the page, and `first_id` / `last_id`. `include` may name
what POST /v1/responses' `include` may; of those only `message.output_text.logprobs` is ever in an input
item (an earlier answer's text parts keep their tokens' logprobs, where it asked for them): without it
they are listed empty.
"""

from __future__ import annotations

import secrets

from frontdoor.openai_responses import INCLUDABLE, LOGPROBS
from tandem.status import InvalidArgument

_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def of_input(given, earlier: tuple[dict, ...]) -> tuple[dict, ...]:
    """The input items of a response asked `given` (its `input`, already read as valid by
    openai_responses.chat_request_of) after the conversation `earlier` (its previous response's items and
    output, or none)."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    return (*earlier, *(_item(i) for i in given))


def _item(given: dict) -> dict:
    kind = given.get("type", "message")
    item = {"id": given.get("id") if isinstance(given.get("id"), str) and given["id"] else _new(kind), "type": kind}
    if kind == "message":
        role = given["role"]
        item |= {"role": role, "content": _parts(given["content"], role), "status": "completed"}
    elif kind == "function_call":
        item |= {k: given[k] for k in ("call_id", "name", "arguments")} | {"status": "completed"}
    elif kind == "function_call_output":
        item |= {"call_id": given["call_id"], "output": given["output"], "status": "completed"}
    else:  # reasoning: as given
        item |= {k: v for k, v in given.items() if k not in ("id", "type")}
    return item


def _parts(content, role: str) -> list[dict]:
    if isinstance(content, list):
        return content
    if role == "assistant":
        return [{"type": "output_text", "text": content, "annotations": []}]
    return [{"type": "input_text", "text": content}]


def _new(kind: str) -> str:
    return f"{_PREFIX[kind]}_{secrets.token_hex(12)}"


def page(items: tuple[dict, ...], query) -> dict:
    """The list object of the page of `items` (oldest first) that `query` (GET's parameters) asks for; a
    400 naming the parameter that is not one of those allowed."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidArgument(f"order must be asc or desc, got {order!r:.40}", "order")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise InvalidArgument(f"limit must be an integer from 1 to 100, got {limit!r:.40}", "limit")
    include = query.getall("include", []) + query.getall("include[]", [])
    if not set(include) <= INCLUDABLE:
        raise InvalidArgument(f"include may name {sorted(INCLUDABLE)}, got {include!r:.120}", "include")
    listed = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(listed) if item["id"] == after), None)
        if at is None:
            raise InvalidArgument(f"after must be the id of one of this response's input items, got {after!r:.80}",
                                  "after")
        listed = listed[at + 1:]
    shown = [_shown(item, LOGPROBS in include) for item in listed[:int(limit)]]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(listed) > len(shown)}


def _shown(item: dict, logprobs: bool) -> dict:
    """`item` as listed: an earlier answer's text parts without their logprobs unless `logprobs`."""
    if logprobs or item["type"] != "message" or not any(p.get("logprobs") for p in item["content"]):
        return item
    return item | {"content": [p | {"logprobs": []} if p.get("logprobs") else p for p in item["content"]]}
