"""The Messages API's replies: one message's content blocks, whole and as streamed events.

A message's `content` lists the blocks its answer made, in order, read from the chat answer the
request amounted to (frontdoor/anthropic_request.py): its reasoning as a `thinking` block (under a
reasoning parser), its text as a `text` block, its tool calls as `tool_use` blocks (`id`, `name`,
`input`: the call's arguments, parsed). `stop_reason` is chat's finish reason in Anthropic's words
(`stop`: `end_turn`, `length`: `max_tokens`; `tool_use` wherever the answer made calls; a stop string
that ended the text: `stop_sequence`, with the string as `stop_sequence`); `usage` counts `input_tokens`,
`output_tokens` and, as `cache_read_input_tokens`, the prompt tokens found in the prefix cache.

Streamed: `message_start` (the message with no content yet), then each block opened
(`content_block_start`), grown (`content_block_delta`: `text_delta`, `thinking_delta`,
`input_json_delta` with the call's arguments as they come) and closed (`content_block_stop`) before
the next opens, then `message_delta` (`stop_reason`, the output tokens) and `message_stop`. A failure
after the stream began is an `error` event.
"""

from __future__ import annotations

import json
import secrets

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_EMPTY = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}
_DELTA = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
          "tool_use": ("input_json_delta", "partial_json")}


def new_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def usage(u: dict) -> dict:
    """Chat's usage in the Messages API's names."""
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": u["prompt_tokens_details"]["cached_tokens"],
            "cache_creation_input_tokens": 0}


def message(mid: str, model: str, content: list[dict], reason: str | None, use: dict, stop=None) -> dict:
    """The message object: ended with chat's finish `reason` (and the `stop` string or token that ended
    it, if any), or not yet (`reason` None)."""
    calls = any(b["type"] == "tool_use" for b in content)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            **(ending(reason, stop, calls) if reason else {"stop_reason": None, "stop_sequence": None}), "usage": use}


def ending(reason: str, stop=None, calls: bool = False) -> dict:
    """`stop_reason` and `stop_sequence`: an answer that made tool calls ends in `tool_use` (chat says
    `stop` for a named tool's); a stop string that ended the text is `stop_sequence`."""
    if calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(stop, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop}
    return {"stop_reason": STOP_REASONS.get(reason, "end_turn"), "stop_sequence": None}


def blocks(chat_message: dict) -> list[dict]:
    """The content blocks of a chat reply's message (its reasoning, text and tool calls)."""
    out = [{"type": "thinking", "thinking": chat_message["reasoning"], "signature": ""}] \
        if chat_message.get("reasoning") else []
    if chat_message.get("content"):
        out.append({"type": "text", "text": chat_message["content"]})
    return out + [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                   "input": _input(c["function"]["arguments"])} for c in chat_message.get("tool_calls") or ()]


class MessageEvents:
    """The streamed events of one message, from its chat chunks' deltas."""

    def __init__(self, mid: str, model: str):
        self.id, self.model = mid, model
        self.kinds: list[str] = []  # each block's kind, in order; the last one is open while `opened`
        self.opened = False

    def start(self, input_tokens: int) -> list[dict]:
        use = {"input_tokens": input_tokens, "output_tokens": 0}
        return [{"type": "message_start", "message": message(self.id, self.model, [], None, use)}]

    def of(self, delta: dict) -> list[dict]:
        """The events of one chat chunk's delta (its reasoning, its text, its calls)."""
        events = self._piece("thinking", delta["reasoning"]) if delta.get("reasoning") else []
        if delta.get("content"):
            events += self._piece("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            args = call["function"].get("arguments") or ""
            if call.get("id"):
                events += self._open("tool_use", {"type": "tool_use", "id": call["id"],
                                                  "name": call["function"]["name"], "input": {}})
            events += [self._delta(args)] if args else []
        return events

    def end(self, reason: str | None, output_tokens: int, stop=None) -> list[dict]:
        return self._close() + [{"type": "message_delta", "delta": ending(reason, stop, "tool_use" in self.kinds),
                                 "usage": {"output_tokens": output_tokens}}, {"type": "message_stop"}]

    def _piece(self, kind: str, text: str) -> list[dict]:
        """A piece of text or thinking: into the open block of its kind, or a new one."""
        events = [] if self.opened and self.kinds[-1] == kind else self._open(kind, _EMPTY[kind])
        return events + [self._delta(text)]

    def _delta(self, piece: str) -> dict:
        kind, field = _DELTA[self.kinds[-1]]
        return {"type": "content_block_delta", "index": len(self.kinds) - 1, "delta": {"type": kind, field: piece}}

    def _open(self, kind: str, block: dict) -> list[dict]:
        events = self._close()
        self.kinds.append(kind)
        self.opened = True
        return events + [{"type": "content_block_start", "index": len(self.kinds) - 1, "content_block": block}]

    def _close(self) -> list[dict]:
        if not self.opened:
            return []
        self.opened = False
        return [{"type": "content_block_stop", "index": len(self.kinds) - 1}]


def _input(arguments: str) -> dict:
    """A call's arguments (JSON text) as tool_use's `input` object."""
    try:
        got = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}
