"""The Responses API's replies: one response's output items, whole and as streamed events.

A response's `output` lists the items its answer made, in order: its `reasoning` (one `reasoning_text`
part; under a reasoning parser, frontdoor/reasoning_text.py), an assistant `message` (its text as one
`output_text` part) and `function_call`s (`call_id`, `name`, `arguments`), read from the chat answer the
request amounted to (frontdoor/openai_responses.py). An answer that cannot make calls (no tools, or
tool_choice "none") and has no reasoning is always one message, even an empty one; otherwise a message
is made only where there is text.

Streamed, the response opens with `response.created` and `response.in_progress`; each item is then
opened (`response.output_item.added`, and a message's or reasoning's `response.content_part.added`),
grows (`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`) and is closed (`response.output_text.done` or
`response.reasoning_text.done` and `response.content_part.done`, or
`response.function_call_arguments.done`; then `response.output_item.done`) before the next one opens;
`response.completed` (or `response.incomplete`) ends it with every item. Each event has its
`sequence_number`.

Where logprobs are asked for (openai_responses.py), a message's `output_text` part carries one entry per
token (chat's `logprobs.content` entries: `token`, `logprob`, `bytes`, `top_logprobs`); each text delta
carries its own tokens' (a token whose text was held back, or dropped by a stop string, comes with the
next delta, or with an empty one before the message closes), so the deltas' entries join to the part's.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from frontdoor.reasoning_text import ThoughtTokens


@dataclass
class _Item:
    kind: str  # "message", "reasoning" or "function_call"
    id: str
    text: str = ""  # a message's or reasoning's text; a call's arguments
    call_id: str = ""
    name: str = ""
    logprobs: list[dict] = field(default_factory=list)  # a message's, one entry per token

    def shaped(self, status: str) -> dict:
        """The item as the API shows it: in progress (empty), or ended with `status`."""
        opened = status == "in_progress"
        if self.kind == "message":
            return {"type": "message", "id": self.id, "status": status, "role": "assistant",
                    "content": [] if opened else [part(self.text, self.logprobs)]}
        if self.kind == "reasoning":
            return {"type": "reasoning", "id": self.id, "summary": [], "status": status,
                    "content": [] if opened else [thought(self.text)]}
        return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": "" if opened else self.text, "status": status}


def part(text: str, logprobs: list[dict] = ()) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def thought(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


class Shaper:
    """One response: its items as the answer makes them, the whole reply, and the streamed events."""

    def __init__(self, body: dict, rid: str, model: str, calls: bool, stored: bool = False,
                 reasoning_parser: str | None = None):
        """`body`: the Responses request (its settings are echoed); `calls`: whether the answer may make
        function calls; `reasoning_parser`: how its reasoning is read, if it may have some (else, without
        calls, it is always one message); `stored`: whether the response is kept."""
        self.body, self.id, self.model, self.calls, self.stored = body, rid, model, calls, stored
        self.thinks = reasoning_parser is not None
        self.thoughts = ThoughtTokens(reasoning_parser) if self.thinks else None  # usage's reasoning_tokens
        self.created, self.seq = int(time.time()), 0
        self.items: list[_Item] = []
        self._open: _Item | None = None  # streaming: the item being written

    def whole(self, content: str | None, calls: list[dict], reason: str | None, usage: dict,
              logprobs: list[dict] = (), reasoning: str | None = None) -> dict:
        """The response to a chat answer whose message had `content`, `calls` (chat tool_calls) and
        `reasoning`, and the logprobs of its text's tokens (asked for only where it makes no calls)."""
        if reasoning:
            self.items.append(_Item("reasoning", _new("rs"), reasoning))
        if content or not (calls or reasoning):
            self.items.append(_Item("message", _new("msg"), content or "", logprobs=list(logprobs)))
        self.items += [_Item("function_call", _new("fc"), c["function"]["arguments"], c["id"], c["function"]["name"])
                       for c in calls]
        return self.response(reason, usage)

    def see(self, delta) -> None:
        """Each delta of the answer (frontdoor.core.Delta), whole or streamed: its reasoning tokens are counted."""
        if self.thoughts is not None:
            self.thoughts.add(delta)

    def response(self, reason: str | None, usage: dict | None, done: bool = True) -> dict:
        """The response object: ended with `reason` (the chat's finish reason) and its items, or in progress."""
        cut = done and reason == "length"
        body = self.body
        fmt = (body.get("text") or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": ("incomplete" if cut else "completed") if done else "in_progress", "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "model": self.model, "output": [self._final(i, reason) for i in self.items] if done else [],
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "previous_response_id": body.get("previous_response_id"), "reasoning": None, "store": self.stored,
                "background": body.get("background") is True,
                "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                "text": {"format": fmt}, "tool_choice": body.get("tool_choice") or "auto",
                "tools": body.get("tools") or [],
                "truncation": body.get("truncation") or "disabled",
                "usage": _usage(usage, self.thoughts.total() if self.thoughts else 0) if usage else None,
                "metadata": body.get("metadata") or {}, "user": body.get("user")}

    def answer(self) -> dict:
        """The answer as the chat assistant message it was: its text and its calls (a follow-up's history)."""
        text = "".join(i.text for i in self.items if i.kind == "message")
        calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.text}}
                 for i in self.items if i.kind == "function_call"]
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": text or None, "tool_calls": calls}

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.seq} | fields
        self.seq += 1
        return out

    def opening(self) -> list[dict]:
        """The events before the first piece of the answer (an answer without calls: its message opened)."""
        events = [self.event(k, response=self.response(None, None, done=False))
                  for k in ("response.created", "response.in_progress")]
        return events + (self._open_item(_Item("message", _new("msg"))) if not (self.calls or self.thinks) else [])

    def text(self, piece: str, logprobs: list[dict] = ()) -> list[dict]:
        """A piece of the answer's text (and its tokens' logprobs): into the open message, or a new one."""
        events = [] if self._open is not None and self._open.kind == "message" else \
            self._open_item(_Item("message", _new("msg")))
        self._open.text += piece
        self._open.logprobs += logprobs
        return events + [self.event("response.output_text.delta", **self._where(), content_index=0, delta=piece,
                                    logprobs=list(logprobs))]

    def reasoning(self, piece: str) -> list[dict]:
        """A piece of the answer's reasoning: into the open reasoning item, or a new one."""
        events = [] if self._open is not None and self._open.kind == "reasoning" else \
            self._open_item(_Item("reasoning", _new("rs")))
        self._open.text += piece
        return events + [self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=piece)]

    def call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        """A new function call, with the first piece of its arguments (maybe all, maybe none)."""
        events = self._open_item(_Item("function_call", _new("fc"), call_id=call_id, name=name))
        return events + (self.arguments(arguments) if arguments else [])

    def arguments(self, piece: str) -> list[dict]:
        """A further piece of the open call's arguments."""
        self._open.text += piece
        return [self.event("response.function_call_arguments.delta", **self._where(), delta=piece)]

    def closing(self, reason: str | None, usage: dict, logprobs: list[dict] = ()) -> list[dict]:
        """The events after the answer's last piece (`logprobs`: its tokens' not yet sent, as an empty
        delta): its open item closed, then the whole response."""
        events = self.text("", logprobs) if logprobs else []
        if not self.calls and not any(i.kind in ("message", "reasoning") for i in self.items):
            events += self._open_item(_Item("message", _new("msg")))  # an empty answer is still one message
        done = self.response(reason, usage)
        return events + self._close(reason) + [self.event(f"response.{done['status']}", response=done)]

    def _open_item(self, item: _Item) -> list[dict]:
        events = self._close(None)
        self.items.append(item)
        self._open = item
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=item.shaped("in_progress")))
        if item.kind != "function_call":
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=part("") if item.kind == "message" else thought("")))
        return events

    def _close(self, reason: str | None) -> list[dict]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        if item.kind == "message":
            events = [self.event("response.output_text.done", **where, content_index=0, text=item.text,
                                 logprobs=list(item.logprobs)),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=part(item.text, item.logprobs))]
        elif item.kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=item.text),
                      self.event("response.content_part.done", **where, content_index=0, part=thought(item.text))]
        else:
            events = [self.event("response.function_call_arguments.done", **where, name=item.name,
                                 arguments=item.text)]
        self._open = None
        return events + [self.event("response.output_item.done", output_index=where["output_index"],
                                    item=self._final(item, reason))]

    def _where(self) -> dict:
        return {"item_id": self._open.id, "output_index": len(self.items) - 1}  # the open item is the last

    def _final(self, item: _Item, reason: str | None) -> dict:
        """An ended item: a message cut by max_output_tokens is incomplete, and so is reasoning cut short."""
        cut = reason == "length" and (item.kind == "message" or (item.kind == "reasoning" and item is self.items[-1]))
        return item.shaped("incomplete" if cut else "completed")


def _new(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _usage(u: dict, reasoning_tokens: int) -> dict:
    """Chat's usage object in the Responses API's names (and the answer's reasoning tokens)."""
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}
