"""Tool calls on the chat door, made as vLLM makes them. With `tool_choice` "required" or a named
function, a guide (tandem/guides.py) forces the answer to be the call's JSON, and the reply shapes it as
OpenAI `tool_calls`. With "auto" (the default with tools) the model decides: its text is read for calls
in its own format by the parser the deployment names (tool_parsers.py); without one, "auto" is
refused, as vLLM refuses it unless started with a parser. "none" shows the tools to the chat template
and answers text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from frontdoor.tool_call_text import Call
from frontdoor.tool_parsers import PARSER_NAMES, CallReader, call_id, reader
from tandem.guides import Guide, GuideKind
from tandem.status import InvalidArgument

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """The answer is one call of `name` (the answer's JSON is its arguments); with `name` None and a
    guide, a JSON list of {"name", "parameters"} calls, at least one (exactly one without parallel tool
    calls); with no guide ("auto"), text in which `parser` (tool_parsers.PARSER_NAMES) finds calls of
    `names`, if any. `parser` (the deployment's, if any) also decides the form of the calls' ids."""

    name: str | None
    guide: Guide | None
    names: frozenset[str] = frozenset()
    parser: str = ""


def tool_choice(body: dict, tools: tuple[dict, ...], parser: str | None = None) -> ToolChoice | None:
    """The request's tool calls, or None for a text answer (no tools, or tool_choice "none"). `parser`:
    the deployment's tool-call parser (tool_parsers.PARSER_NAMES), which "auto" needs."""
    choice = body.get("tool_choice")
    if not tools:
        if choice in (None, "none", "auto"):
            return None
        raise InvalidArgument("tool_choice needs tools: send the functions it may call in 'tools'", "tool_choice")
    functions = _functions(tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgument(f"'parallel_tool_calls' must be a boolean, got {parallel!r}", "parallel_tool_calls")
    if choice == "none":
        return None
    if choice in (None, "auto"):
        if parser is None:
            raise InvalidArgument(f"tool_choice \"auto\" (the default with tools) needs a parser of this model's own "
                                  f"tool-call format, and this server was started without one (tandem serve "
                                  f"--tool-call-parser {' or '.join(PARSER_NAMES)}): send tool_choice \"required\", a "
                                  f"named function ({{\"type\": \"function\", \"function\": {{\"name\": ...}}}}) or "
                                  f"\"none\"", "tool_choice")
        return ToolChoice(None, None, frozenset(functions), parser)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"enum": [n]}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False} for n, p in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({"maxItems": 1} if parallel is False
                                                                                 else {})
        return ToolChoice(None, Guide(GuideKind.JSON_SCHEMA, json.dumps(schema)), parser=parser or "")
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in functions:
        raise InvalidArgument(f"tool_choice must be \"none\", \"required\" or {{\"type\": \"function\", \"function\": "
                              f"{{\"name\": one of {sorted(functions)}}}}}, got {choice!r}"[:400], "tool_choice")
    return ToolChoice(name, Guide(GuideKind.JSON_SCHEMA, json.dumps(functions[name])), parser=parser or "")


def _functions(tools: tuple[dict, ...]) -> dict[str, dict]:
    """name -> parameters schema of each {"type": "function", "function": {"name", "parameters"}}."""
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if t.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name) or name in out:
            raise InvalidArgument(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                  f"with a distinct name of 1-64 letters, digits, '_' or '-'", "tools")
        params = fn.get("parameters", _NO_ARGUMENTS)
        if not isinstance(params, dict):
            raise InvalidArgument(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        out[name] = params
    return out


class ToolCallShape:
    """The chat shape (openai_api.chat_body, given as `chat`) for answers that are, or may hold, tool
    calls; one per request (it names each choice's calls, holds a streamed "required" choice's text until
    its list is complete, and reads each "auto" choice's text as it comes)."""

    def __init__(self, choice: ToolChoice, chat):
        self.choice, self.chat = choice, chat
        self._ids: dict[int, str] = {}
        self._held: dict[int, str] = {}
        self._readers: dict[int, CallReader] = {}  # "auto": each streamed choice's reader

    def __call__(self, rid: str, model: str, text: str, reason: str | None, usage_: dict | None, chunk: bool,
                 first: bool = False, logprobs: dict | None = None, index: int = 0) -> dict | None:
        """A reply (chunk: an SSE event) like chat_body's; None while nothing of a choice can go out yet
        (a "required" list incomplete, an "auto" text that may be a call)."""
        if self.choice.guide is None:
            return self._auto(rid, model, text, reason, usage_, chunk, first, logprobs, index)
        body = self.chat(rid, model, "", reason, usage_, chunk, first, logprobs, index)
        out = body["choices"][0]
        if not chunk:
            calls = self._named(text, index) if self.choice.name is not None else self._listed(text)
            out["message"] = {"role": "assistant", "content": None if calls else text, "tool_calls": calls}
            return body
        content = None
        if self.choice.name is not None:  # each piece of text is a piece of the call's arguments
            calls = self._named(text, index, streamed=True)
        elif not reason:  # "required": held until the choice ends, then shaped whole
            if text:
                self._held[index] = self._held.get(index, "") + text
                return None
            calls = []
        else:
            held = self._held.pop(index, "") + text
            calls = self._listed(held, streamed=True)
            content = None if calls else held  # cut short (max_tokens): not a list of calls, its text
        out["delta"] = ({"role": "assistant"} if first else {}) | ({"tool_calls": calls} if calls else {}) \
            | ({"content": content} if content else {})
        return body

    def _auto(self, rid, model, text, reason, usage_, chunk, first, logprobs, index) -> dict | None:
        """tool_choice "auto": the calls the text holds (tool_call_text.py), the rest its content; a
        choice that made calls and stopped ends with finish_reason "tool_calls", as OpenAI's do."""
        if not chunk:
            read = reader(self.choice.parser, self.choice.names)
            content, calls = read.feed(text)
            rest, more = read.finish()
            content, calls = content + rest, calls + more
            body = self.chat(rid, model, "", _reason(reason, read), usage_, chunk, first, logprobs, index)
            body["choices"][0]["message"] = {"role": "assistant", "content": content if content or not calls
                                             else None, "tool_calls": [self._shaped(c) for c in calls]}
            return body
        read = self._readers.setdefault(index, reader(self.choice.parser, self.choice.names))
        made_before = read.calls
        content, calls = read.feed(text)
        if reason:
            rest, more = read.finish()
            content, calls = content + rest, calls + more
            del self._readers[index]
        if text and not (content or calls or reason):
            return None  # all of it may be (part of) a call: held
        body = self.chat(rid, model, "", _reason(reason, read), usage_, chunk, first, logprobs, index)
        shaped = [{"index": made_before + i} | self._shaped(c) for i, c in enumerate(calls)]
        body["choices"][0]["delta"] = ({"role": "assistant"} if first else {}) \
            | ({"content": content} if content else {}) | ({"tool_calls": shaped} if shaped else {})
        return body

    def _named(self, text: str, index: int, streamed: bool = False) -> list[dict]:
        """The named function's call with `text` as its arguments; streamed, a piece of them (the call's
        id, type and name come with the choice's first piece)."""
        if streamed and index in self._ids:
            return [{"index": 0, "function": {"arguments": text}}] if text else []
        self._ids[index] = call_id(self.choice.parser)
        call = {"id": self._ids[index], "type": "function", "function": {"name": self.choice.name, "arguments": text}}
        return [{"index": 0} | call] if streamed else [call]

    def _listed(self, text: str, streamed: bool = False) -> list[dict]:
        """The calls of a "required" answer's list; [] when it is not a complete list (cut short)."""
        try:
            made = json.loads(text)
        except ValueError:
            return []
        calls = [{"id": call_id(self.choice.parser), "type": "function",
                  "function": {"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}}
                 for c in made]
        return [{"index": i} | c for i, c in enumerate(calls)] if streamed else calls

    def _shaped(self, call: Call) -> dict:
        return {"id": call_id(self.choice.parser), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}


def _reason(reason: str | None, read: CallReader) -> str | None:
    return "tool_calls" if reason == "stop" and read.calls else reason


