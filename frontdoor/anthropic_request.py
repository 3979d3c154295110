"""Anthropic's Messages API (POST /v1/messages): its requests, read as the chat door's.

As vLLM, SGLang and llama.cpp's server do, for clients written against Anthropic's API (Claude Code
and the `anthropic` SDK among them). A Messages request is read into the chat completions request it
amounts to, so it is prepared, admitted and served exactly as that chat is; only the shapes differ
(the replies: anthropic_shape.py):

- `system` (a string or text blocks) is a system message before `messages`;
- `messages`: `user` and `assistant` turns, content a string or blocks: `text`; an assistant's
  `tool_use` (`id`, `name`, `input`: a chat tool call, its arguments the input as JSON); a user's
  `tool_result` (`tool_use_id`, `content`: a string or text blocks; a tool message, before the turn's
  text); `thinking` and `redacted_thinking` blocks are dropped (earlier thinking is not shown again);
  images and documents are refused;
- `max_tokens` (required, as Anthropic's API has it), `temperature`, `top_p`, `top_k` (which recent
  `anthropic` SDKs send through `extra_body`), `stop_sequences` (chat's `stop`), `stream`;
- `output_config.format` (`{"type": "json_schema", "schema"}`: structured output, chat's
  `response_format`); its `effort` changes nothing;
- `tools` (`name`, `description`, `input_schema`: chat's function tools) and `tool_choice` (`auto`,
  `any` = chat's "required", `tool` with a `name`, `none`; `disable_parallel_tool_use` = chat's
  `parallel_tool_calls: false`); Anthropic's server tools (web search, bash, ...) are refused;
- `metadata`, `thinking`, `service_tier` change nothing; any other field is named once in the log.

Errors name the Messages fields (`stop_sequences` for chat's `stop`). POST /v1/messages/count_tokens
takes `model`, `messages`, `system`, `tools`, `tool_choice`, `thinking` and `output_config` as a
Messages request does, and counts the prompt that request would have (its `usage.input_tokens`).
"""

from __future__ import annotations

import contextlib
import json

from frontdoor.openai_tools import FUNCTION_NAME
from tandem.status import InvalidArgument, TandemError

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "tools", "tool_choice", "output_config", "metadata", "thinking", "service_tier"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_request_of(body: dict) -> tuple[dict, list[str]]:
    """(the chat completions body this Messages request amounts to, its fields unknown here)."""
    n = body.get("max_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgument(f"max_tokens is required: an integer >= 1, got {n!r:.40}", "max_tokens")
    messages = [{"role": "system", "content": _text(body["system"], "system")}] if body.get("system") else []
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise InvalidArgument("messages must be a non-empty list of {\"role\": \"user\" | \"assistant\", "
                              "\"content\"}", "messages")
    for i, turn in enumerate(turns):
        messages += _turn(turn, i)
    chat = {"model": body.get("model"), "messages": messages, "max_tokens": n, "stream": body.get("stream"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
            "stop": body.get("stop_sequences")}
    chat |= _tools(body.get("tools"), body.get("tool_choice"))
    chat |= _output(body.get("output_config"))
    return chat, sorted(set(body) - FIELDS)


def count_request_of(body: dict) -> tuple[dict, list[str]]:
    """(the chat body whose prompt a count_tokens request counts, its fields unknown there): the Messages
    request it would be, with one token to generate (its max_tokens changes no prompt token)."""
    chat, _ = chat_request_of({k: v for k, v in body.items() if k in COUNT_FIELDS} | {"max_tokens": 1})
    return chat, sorted(set(body) - COUNT_FIELDS)


@contextlib.contextmanager
def named_as_messages():
    """Errors of the chat a Messages request became name its own fields."""
    try:
        yield
    except TandemError as e:
        e.param = {"stop": "stop_sequences", "response_format": "output_config"}.get(e.param, e.param)
        raise


def _turn(turn, i: int) -> list[dict]:
    """One Messages turn as chat messages (a user turn's tool results first, as tool messages)."""
    role = turn.get("role") if isinstance(turn, dict) else None
    if role not in ("user", "assistant"):
        raise InvalidArgument(f"messages[{i}].role must be \"user\" or \"assistant\"", "messages")
    content = turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidArgument(f"messages[{i}].content must be a string or a list of content blocks", "messages")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            fn = {"name": _name(block, "name", where), "arguments": json.dumps(block.get("input", {}))}
            calls.append({"id": _name(block, "id", where), "type": "function", "function": fn})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": _name(block, "tool_use_id", where),
                            "content": _text(block.get("content", ""), f"{where}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier thinking: not shown to the model again
        else:
            allowed = "a tool_use or thinking block" if role == "assistant" else "a tool_result block"
            raise InvalidArgument(f"{where} must be a text block or {allowed}; images and documents are not served",
                                  "messages")
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(texts) or None} | ({"tool_calls": calls} if calls else {})]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _name(block: dict, field: str, where: str) -> str:
    value = block.get(field)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{where}.{field} must be a non-empty string", "messages")
    return value


def _text(content, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise InvalidArgument(f"{where} must be a string or a list of text blocks (only text is served)",
                          "system" if where == "system" else "messages")


def _output(config) -> dict:
    """`output_config` as chat's `response_format` (its `effort` changes nothing)."""
    if config is None:
        return {}
    fmt = config.get("format") if isinstance(config, dict) else "not an object"
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise InvalidArgument("output_config must be an object whose format is {\"type\": \"json_schema\", "
                              "\"schema\": {...}}", "output_config")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


def _tools(tools, choice) -> dict:
    """`tools` and `tool_choice` as chat's fields."""
    if tools in (None, []):
        if choice is not None and (not isinstance(choice, dict) or choice.get("type") != "none"):
            raise InvalidArgument("tool_choice needs tools", "tool_choice")
        return {}
    if not isinstance(tools, list):
        raise InvalidArgument("tools must be a list of {\"name\", \"description\", \"input_schema\"}", "tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        name = t.get("name") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") or "input_schema" not in t:
            raise InvalidArgument(f"tools[{i}]: only client tools ({{\"name\", \"description\", \"input_schema\"}}) "
                                  f"are served, not Anthropic's server tools (web search, bash, ...)", "tools")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name) or name in names:
            raise InvalidArgument(f"tools[{i}].name must be a distinct name of 1-64 letters, digits, '_' or '-'",
                                  "tools")
        names.add(name)
        fn = {"name": name, "parameters": t["input_schema"]} | ({"description": t["description"]}
                                                                 if "description" in t else {})
        out.append({"type": "function", "function": fn})
    chat: dict = {"tools": out}
    if choice is None:
        return chat
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _CHOICES:
        chat["tool_choice"] = _CHOICES[kind]
    else:
        raise InvalidArgument(f"tool_choice must be {{\"type\": \"auto\" | \"any\" | \"none\"}} or {{\"type\": "
                              f"\"tool\", \"name\"}}, got {choice!r:.80}", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False
    return chat
