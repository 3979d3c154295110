"""OpenAI's Responses API (POST /v1/responses), text in and text out, as a codec over the chat door.

A Responses request is read into the chat completions request it amounts to (`chat_request_of`), so it
is prepared, admitted and served exactly as that chat is, by the same core; only the shapes differ:

- `input`: a string (one user message) or a list of messages, `{"role", "content"}` with an optional
  `"type": "message"`, content a string or `input_text` / `output_text` parts; `developer` is a system
  message. `instructions` is a system message before them.
- `max_output_tokens` is max_tokens; `temperature`, `top_p` as in chat; vLLM's sampling fields (top_k,
  seed, min_p, guided_json, ...) too. `text.format` (`text`, `json_object`, `json_schema`) is chat's
  response_format.
- Refused with a 400 naming the field: `tools` (non-empty), `previous_response_id`, `background: true`,
  `truncation: "auto"`, a non-empty `include`, `top_logprobs` above 0, input items that are not text
  messages. Responses are not stored: the reply says `"store": false`, whatever the request said.
  `reasoning`, `parallel_tool_calls`, `stream_options` and bookkeeping (`metadata`, `user`, ...) change
  nothing. Errors name the Responses fields (max_output_tokens, input, text), not chat's.
- The reply: a `response` whose `output` is one assistant message of one `output_text` part; `status`
  "completed", or "incomplete" with `incomplete_details.reason` "max_output_tokens" when the answer hit
  it. Streamed: the Responses events (`response.created`, `response.in_progress`,
  `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
  `response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
  `response.completed`), each with its `sequence_number`; a failure after the stream began is an
  `error` event.
"""

from __future__ import annotations

import contextlib
import secrets
import time

from frontdoor.openai_fields import CHAT_FIELDS
from tandem.status import InvalidArgument, TandemError

_SHAPE = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store", "text",
          "tools", "tool_choice", "parallel_tool_calls", "previous_response_id", "background", "include",
          "truncation", "top_logprobs", "reasoning", "stream_options"}
_BOOKKEEPING = {"metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key"}  # change no token
FIELDS = _SHAPE | _BOOKKEEPING
# chat fields a Responses request may also carry (vLLM's sampling extras); the chat-only shapes are not among them
_CARRIED = CHAT_FIELDS - {"model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n",
                          "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "functions",
                          "function_call", "response_format", "best_of", "modalities", "echo", "prompt_logprobs",
                          "return_token_ids", "return_tokens_as_token_ids", "documents", *_BOOKKEEPING}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def chat_request_of(body: dict) -> tuple[dict, list[str]]:
    """(the chat completions body this Responses request amounts to, its fields neither shape knows)."""
    _refuse(body)
    messages = [{"role": "system", "content": _text(body["instructions"], "instructions")}] \
        if body.get("instructions") is not None else []
    messages += _messages(body.get("input"))
    chat = {"model": body.get("model"), "messages": messages, "max_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "stream": body.get("stream")}
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    chat |= {k: v for k, v in body.items() if k in _CARRIED}
    return chat, sorted(set(body) - FIELDS - _CARRIED)


@contextlib.contextmanager
def named_as_responses():
    """Errors of the chat a Responses request became name its own fields (max_output_tokens, input, text)."""
    try:
        yield
    except TandemError as e:
        e.param = _RENAMED.get(e.param, e.param)
        raise


_RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input", "response_format": "text"}


def _refuse(body: dict) -> None:
    """Fields whose values would change the answer in ways not served: refused, never ignored."""
    refused = {"tools": "tools are not served on /v1/responses; send them to /v1/chat/completions",
               "previous_response_id": "responses are not stored, so none can be continued; send the whole "
                                       "conversation as input",
               "include": "include is not served (no logprobs, reasoning or tool outputs to add)"}
    for name, why in refused.items():
        if body.get(name) not in (None, [], ""):
            raise InvalidArgument(f"{name}: {why}", name)
    if body.get("background") not in (None, False):
        raise InvalidArgument("background: responses are answered in the request, never in the background",
                              "background")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidArgument("truncation: only \"disabled\" is served (an input longer than the context is a 400)",
                              "truncation")
    if body.get("top_logprobs") not in (None, 0):
        raise InvalidArgument("top_logprobs: logprobs are not served on /v1/responses; use /v1/chat/completions",
                              "top_logprobs")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise InvalidArgument("tool_choice: there are no tools here; leave it out", "tool_choice")
    if not isinstance(body.get("text") or {}, dict):
        raise InvalidArgument("text must be an object such as {\"format\": {\"type\": \"text\"}}", "text")
    n = body.get("max_output_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise InvalidArgument(f"max_output_tokens must be an integer >= 1 or null, got {n!r}", "max_output_tokens")


def _messages(items) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidArgument("input must be a string or a non-empty list of messages", "input")
    out = []
    for i, m in enumerate(items):
        if not isinstance(m, dict) or m.get("type", "message") != "message" or m.get("role") not in _ROLES:
            raise InvalidArgument(f"input[{i}] must be a message {{\"role\": one of {sorted(_ROLES)}, \"content\"}}; "
                                  f"other items (function calls and outputs, references) are not served", "input")
        out.append({"role": _ROLES[m["role"]], "content": _text(m.get("content"), f"input[{i}].content")})
    return out


def _text(content, where: str) -> str:
    """A message's text: a string, or input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidArgument(f"{where} must be a string or a list of input_text parts (only text is served)", "input")


def _response_format(fmt) -> dict:
    """text.format as chat's response_format."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise InvalidArgument("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                          "\"json_schema\", \"name\", \"schema\"}", "text")


class Shaper:
    """One response's objects: the whole reply, and the streamed events in order."""

    def __init__(self, body: dict, rid: str, model: str):
        self.body, self.id, self.model = body, rid, model
        self.item = f"msg_{secrets.token_hex(12)}"
        self.created, self.seq = int(time.time()), 0

    def response(self, text: str | None, reason: str | None, usage: dict | None) -> dict:
        """The response object: in progress (text None), or ended with `reason` (chat's finish reason)."""
        done = text is not None
        cut = reason == "length"
        body = self.body
        fmt = (body.get("text") or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": ("incomplete" if cut else "completed") if done else "in_progress", "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "model": self.model, "output": [self.message(text, reason)] if done else [],
                "parallel_tool_calls": True, "previous_response_id": None, "reasoning": None, "store": False,
                "temperature": body.get("temperature"), "top_p": body.get("top_p"), "text": {"format": fmt},
                "tool_choice": body.get("tool_choice") or "auto", "tools": [], "truncation": "disabled",
                "usage": _usage(usage) if usage else None, "metadata": body.get("metadata") or {},
                "user": body.get("user")}

    def message(self, text: str | None, reason: str | None) -> dict:
        content = [] if text is None else [self.part(text)]
        status = "in_progress" if text is None else "incomplete" if reason == "length" else "completed"
        return {"type": "message", "id": self.item, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.seq} | fields
        self.seq += 1
        return out

    def opening(self) -> list[dict]:
        """The events before the first delta."""
        where = {"item_id": self.item, "output_index": 0, "content_index": 0}
        return [self.event("response.created", response=self.response(None, None, None)),
                self.event("response.in_progress", response=self.response(None, None, None)),
                self.event("response.output_item.added", output_index=0, item=self.message(None, None)),
                self.event("response.content_part.added", **where, part=self.part(""))]

    def delta(self, text: str) -> dict:
        return self.event("response.output_text.delta", item_id=self.item, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, text: str, reason: str | None, usage: dict) -> list[dict]:
        where = {"item_id": self.item, "output_index": 0, "content_index": 0}
        done = self.response(text, reason, usage)
        return [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=self.part(text)),
                self.event("response.output_item.done", output_index=0, item=self.message(text, reason)),
                self.event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                           response=done)]


def _usage(u: dict) -> dict:
    """Chat's usage object in the Responses API's names."""
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}
