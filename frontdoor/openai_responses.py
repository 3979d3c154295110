"""OpenAI's Responses API (POST /v1/responses): its requests, read as the chat door's.

A Responses request is read into the chat completions request it amounts to (`chat_request_of`), so it
is prepared, admitted and served exactly as that chat is, by the same core; only the shapes differ
(the replies: responses_shape.py):

- `input`: a string (one user message) or a list of items (an `item_reference` stands for a kept
  response's item, put in its place first): messages, `{"role", "content"}` with an
  optional `"type": "message"`, content a string or `input_text` / `output_text` parts (`developer` is
  a system message); `function_call` items (`call_id`, `name`, `arguments`: an assistant's tool calls,
  joined to the assistant message just before them, if any) and `function_call_output` items
  (`call_id`, `output`: a tool message); `reasoning` items are dropped (earlier thinking is not shown to
  the model again). `instructions` is a system message before them.
- `tools` (function tools, `{"type": "function", "name", "description", "parameters"}`),
  `tool_choice` ("none", "auto", "required", or `{"type": "function", "name"}`) and
  `parallel_tool_calls` are chat's, so calls are made, forced and parsed as on the chat door.
- `max_output_tokens` is max_tokens; `temperature`, `top_p` as in chat; vLLM's sampling fields (top_k,
  seed, min_p, guided_json, ...) too. `text.format` (`text`, `json_object`, `json_schema`) is chat's
  response_format.
- `include: ["message.output_text.logprobs"]` is chat's `logprobs: true`, with `top_logprobs` (0..20)
  alternatives per token; refused where the answer may make calls (a call's tokens have no place for
  them). The other includables are accepted and add nothing: they name items never made here (hosted
  tools' results, images) or reasoning's encrypted form (reasoning items, where made, are plain text).
- `background: true` answers after the reply (response_background.py), where responses are kept; with
  `stream: true` its events can be followed again (GET `?stream=true&starting_after=N`).
- `truncation: "auto"` drops the conversation's oldest turns (its instructions and leading system
  messages stay) until it fits the context with its max_output_tokens (control/requests.py); "disabled"
  (the default) refuses a conversation that does not fit.
- Refused with a 400 naming the field: tools other than functions (hosted tools), `top_logprobs` above 0
  without the logprobs include, input items other than the above, and state this server does not keep
  (`conversation`, a reusable `prompt`): ignoring them would answer without it.
- `previous_response_id` continues a kept response's conversation (its instructions aside), where the
  server keeps responses (response_store.py). `reasoning`, `stream_options` and bookkeeping
  (`metadata`, `user`, ...) change nothing. Errors name the Responses fields (max_output_tokens, input,
  text), not chat's.
"""

from __future__ import annotations

import contextlib

from frontdoor.openai_fields import CHAT_FIELDS
from frontdoor.openai_tools import FUNCTION_NAME
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
LOGPROBS = "message.output_text.logprobs"
# what `include` may name: the logprobs, and what is never made here (so including it adds nothing)
INCLUDABLE = {LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs"}


def chat_request_of(body: dict, earlier: tuple[dict, ...] = ()) -> tuple[dict, list[str]]:
    """(the chat completions body this Responses request amounts to, its fields neither shape knows).
    `earlier`: the chat messages of the conversation it continues (its previous response's)."""
    _refuse(body)
    messages = [{"role": "system", "content": _text(body["instructions"], "instructions")}] \
        if body.get("instructions") is not None else []
    messages += [*earlier, *_messages(body.get("input"))]
    chat = {"model": body.get("model"), "messages": messages, "max_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "stream": body.get("stream"),
            "tools": [{"type": "function", "function": t} for t in _functions(body.get("tools"))],
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls")}
    if _included(body.get("include")):
        if chat["tools"] and chat["tool_choice"] != "none":
            raise InvalidArgument(f"include: {LOGPROBS} is served for text answers only; with tools the answer may "
                                  f"be calls (set tool_choice \"none\", or drop the include)", "include")
        chat |= {"logprobs": True, "top_logprobs": body.get("top_logprobs") or 0}
    elif body.get("top_logprobs") not in (None, 0):
        raise InvalidArgument(f"top_logprobs needs include: [\"{LOGPROBS}\"]", "top_logprobs")
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    chat |= {k: v for k, v in body.items() if k in _CARRIED}
    return chat, sorted(set(body) - FIELDS - _CARRIED)


def refuse_state_elsewhere(body: dict) -> None:
    """A 400 naming `conversation` or `prompt` where given: state this server does not keep (ignoring it
    would answer without it). Called outside `named_as_responses`: `prompt` is the Responses field here."""
    for name, why in _ELSEWHERE.items():
        if body.get(name) is not None:
            raise InvalidArgument(f"{name}: {why}", name)


def is_reference(item) -> bool:
    """Whether an input item is an `item_reference` (`{"type": "item_reference", "id"}`: an item of a kept
    response, put in its place before the request is read: frontdoor/http_responses.py)."""
    return isinstance(item, dict) and item.get("type") == "item_reference"


def in_background(body: dict, kept: bool) -> bool:
    """Whether the response is answered in the background (response_background.py), where `kept`: whether
    it will be kept (a server keeping responses, and `store`). A 400 where it cannot be."""
    value = body.get("background")
    if value in (None, False):
        return False
    if value is not True:
        raise InvalidArgument(f"background must be a boolean, got {value!r:.80}", "background")
    if not kept:
        raise InvalidArgument("background: a background response is read back with GET /v1/responses/{id}, so it "
                              "needs store (the default) on a server that keeps responses (tandem serve "
                              "--responses-kept N)", "background")
    return True


def truncated(body: dict) -> bool:
    """Whether the oldest turns are dropped where the conversation does not fit (`truncation: "auto"`)."""
    return body.get("truncation") == "auto"


def asked(chat: dict, body: dict) -> tuple[dict, ...]:
    """The conversation a follow-up of this request continues, before its answer: the chat's messages
    without the request's instructions (they do not carry over)."""
    return tuple(chat["messages"][1:] if body.get("instructions") is not None else chat["messages"])


@contextlib.contextmanager
def named_as_responses():
    """Errors of the chat a Responses request became name its own fields (max_output_tokens, input, text)."""
    try:
        yield
    except TandemError as e:
        e.param = _RENAMED.get(e.param, e.param)
        raise


# fields whose state lives where this server keeps none: refused, since ignoring them would lose it
_ELSEWHERE = {"conversation": "the Conversations API is not served; continue a conversation with "
                              "previous_response_id (tandem serve --responses-kept N) or send it whole as input",
              "prompt": "reusable prompts (prompt templates kept by id) are not served; send instructions and "
                        "input"}
_RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input", "response_format": "text"}


def _refuse(body: dict) -> None:
    """Fields whose values would change the answer in ways not served: refused, never ignored."""
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise InvalidArgument(f"truncation must be \"auto\" or \"disabled\", got {body['truncation']!r:.80}",
                              "truncation")
    if not isinstance(body.get("text") or {}, dict):
        raise InvalidArgument("text must be an object such as {\"format\": {\"type\": \"text\"}}", "text")
    n = body.get("max_output_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise InvalidArgument(f"max_output_tokens must be an integer >= 1 or null, got {n!r}", "max_output_tokens")


def _included(include) -> bool:
    """Whether `include` asks for the answer's logprobs; anything it may not name is a 400."""
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(i, str) and i in INCLUDABLE for i in include):
        raise InvalidArgument(f"include must be a list of {sorted(INCLUDABLE)}, got {include!r:.120}", "include")
    return LOGPROBS in include


def _functions(tools) -> list[dict]:
    """The request's function tools as chat's function objects ({"name", "description", "parameters"})."""
    if tools in (None, []):
        return []
    if not isinstance(tools, list):
        raise InvalidArgument("tools must be a list of function tools", "tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise InvalidArgument(f"tools[{i}]: only function tools ({{\"type\": \"function\", \"name\", "
                                  f"\"parameters\"}}) are served, not hosted ones (web search, file search, MCP, ...)",
                                  "tools")
        name = t.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name) or name in names:
            raise InvalidArgument(f"tools[{i}].name must be a distinct name of 1-64 letters, digits, '_' or '-'",
                                  "tools")
        names.add(name)
        out.append({k: t[k] for k in ("name", "description", "parameters") if k in t})
    return out


def _tool_choice(choice):
    """tool_choice in chat's form."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidArgument(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                          f"\"name\": ...}}, got {choice!r:.80}", "tool_choice")


def _messages(items) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidArgument("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, m in enumerate(items):
        kind = m.get("type", "message") if isinstance(m, dict) else None
        if kind == "function_call":
            call = {"id": _field(m, "call_id", i), "type": "function",
                    "function": {"name": _field(m, "name", i), "arguments": _field(m, "arguments", i)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _field(m, "call_id", i),
                        "content": _text(m.get("output"), f"input[{i}].output")})
        elif kind == "reasoning":
            continue  # earlier thinking: not shown to the model again (thinking models' templates drop it too)
        elif kind == "message" and m.get("role") in _ROLES:
            out.append({"role": _ROLES[m["role"]], "content": _text(m.get("content"), f"input[{i}].content")})
        else:
            raise InvalidArgument(f"input[{i}] must be a message {{\"role\": one of {sorted(_ROLES)}, \"content\"}}, "
                                  f"a function_call, a function_call_output, reasoning or an item_reference; "
                                  f"other items (hosted tools' calls) are not served", "input")
    return out


def _field(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and name != "arguments"):
        raise InvalidArgument(f"input[{i}].{name} must be a{' non-empty' if name != 'arguments' else ''} string",
                              "input")
    return value


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
