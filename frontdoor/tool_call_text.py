"""Tool calls a model writes in its own words (tool_choice "auto"): which of its text is a call.

With "auto" the model decides between answering and calling, so nothing forces the answer's shape:
the calls are read out of the text afterwards, by a parser of the model's own call format, named by
the deployment (`front_door.tool_call_parser`, as vLLM's `--tool-call-parser`; tool_parsers.py names
them). Three formats are read here, `mistral` in tool_call_mistral.py:

- `hermes` (Hermes 2 Pro, Qwen 2.5 and 3, SmolLM3 and others): each call is a block
  `<tool_call>{"name": "...", "arguments": {...}}</tool_call>` anywhere in the answer.
  A block that is not a call stays text. The text outside the blocks is the answer's content, its
  whitespace around the calls dropped. Streamed, content goes out as it comes, except what may be the
  start of a block (a prefix of `<tool_call>`) or whitespace that may precede one; a call goes out
  whole once its block closed. A block left open when the answer ends (cut short by max_tokens) is text.
- `llama3_json` (Llama 3.1, 3.2 and 3.3 with JSON tool calling): the whole answer is the calls, or it
  is text. Calls are JSON objects `{"name": "...", "parameters": {...}}` separated by `;`, after an
  optional `<|python_tag|>`. Streamed, an answer that may be calls (its first non-blank character is
  `{`, or it begins the tag) is held to its end and then given as calls or, if any part is not a call,
  as its text; any other answer is content as it comes.
- `pythonic` (Llama 3.2 and 4, ToolACE): the whole answer is the calls, or it is text, as with
  `llama3_json`. Calls are a Python list, `[get_weather(city="Oslo"), get_time()]`, keyword arguments
  only, each value a literal (strings, numbers, True/False/None, lists and dicts of them). Streamed, an
  answer whose first non-blank character is `[` is held to its end.

A JSON object is a call only if it names one of the request's tools, with `arguments` (or
`parameters`) an object or a string holding one. An answer without a call is its text, unchanged.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the arguments as a JSON object's text


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"  # hermes


class HermesReader:
    """One answer's text in the `hermes` format, fed piece by piece: what of it is content and which calls
    it made. Every reader has this interface: `feed`, `finish` and `calls`."""

    def __init__(self, names: frozenset[str]):
        self.names = names  # the request's tools: a block naming another function stays text
        self._buf = ""  # text not yet given out: a possible start of a block, or an open block
        self._blank = ""  # whitespace held after content: dropped if a call follows it
        self._before = ""  # the whitespace held when the open block began (restored if it is text)
        self._in_call = False
        self._after_call = False  # no content since the last call: its leading whitespace is dropped
        self.calls = 0  # calls made so far

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """(content to give out now, calls completed now) after the next piece of the answer."""
        self._buf += text
        out, calls = [], []
        while self._buf:
            if self._in_call:
                end = self._buf.find(_CLOSE)
                if end < 0:
                    break  # the block is still open: hold it
                body, self._buf, self._in_call = self._buf[:end], self._buf[end + len(_CLOSE):], False
                call = self._call(body)
                if call is None:  # text after all: the whitespace before it goes out with it
                    self._blank = self._before
                    out.append(self._content(_OPEN + body + _CLOSE))
                else:
                    calls.append(call)
                    self.calls, self._blank, self._after_call = self.calls + 1, "", True
                continue
            start = self._buf.find(_OPEN)
            if start >= 0:
                out.append(self._content(self._buf[:start]))
                self._buf, self._in_call = self._buf[start + len(_OPEN):], True
                self._before, self._blank = self._blank, ""
                continue
            keep = partial_tag(self._buf, _OPEN)  # the tail that may become "<tool_call>"
            out.append(self._content(self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(out), calls

    def finish(self) -> tuple[str, list[Call]]:
        """(content, calls) still held once the answer ended: an open block's text, and trailing whitespace
        unless a call was made; never a call in this format."""
        held = self._buf
        if self._in_call:  # cut short: the block is text, with the whitespace before it
            held, self._blank = _OPEN + held, self._before
        self._buf, self._in_call = "", False
        out = self._content(held)
        if not self.calls:
            out += self._blank
        self._blank = ""
        return out, []

    def _content(self, text: str) -> str:
        """Content to give out: the whitespace held before it, then `text` less its trailing whitespace
        (held: it goes out with the next content, or is dropped if a call comes first). After a call,
        the whitespace that starts the next content is dropped too."""
        if self._after_call:
            text = text.lstrip()
        kept = text.rstrip()
        if not kept:
            self._blank += text
            return ""
        out, self._after_call = self._blank + kept, False
        self._blank = text[len(kept):]
        return out

    def _call(self, body: str) -> Call | None:
        try:
            return json_call(json.loads(body), self.names)
        except ValueError:
            return None


class _WholeAnswerReader:
    """A format whose calls are the whole answer or nothing (HermesReader's interface): the answer is held
    while it may be calls (`_may_be_calls` of its text so far, leading blanks stripped), then given as
    its calls (`_parse`) or, if any part is not one, as its text."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self._held = ""  # the answer so far, while it may be calls
        self._text = False  # it cannot be calls: content as it comes
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[Call]]:
        if self._text:
            return text, []
        self._held += text
        head = self._held.lstrip()
        if not head or self._may_be_calls(head):
            return "", []
        self._text, held, self._held = True, self._held, ""
        return held, []

    def finish(self) -> tuple[str, list[Call]]:
        held, self._held = self._held, ""
        calls = None if self._text else self._parse(held.strip())
        if not calls:
            return held, []
        self.calls = len(calls)
        return "", calls

    def _may_be_calls(self, head: str) -> bool:
        raise NotImplementedError

    def _parse(self, text: str) -> list[Call] | None:
        """The calls `text` is, or None if any part of it is not one (or it holds none)."""
        raise NotImplementedError


class Llama3JsonReader(_WholeAnswerReader):
    """`llama3_json`: JSON objects separated by `;`, after an optional <|python_tag|>."""

    def _may_be_calls(self, head: str) -> bool:
        return head.startswith("{") or _PYTHON_TAG.startswith(head[:len(_PYTHON_TAG)])

    def _parse(self, text: str) -> list[Call] | None:
        text = text.removeprefix(_PYTHON_TAG)
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            at = _skip_blank(text, at)
            try:
                made, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            call = json_call(made, self.names)
            if call is None:
                return None
            calls.append(call)
            at = _skip_blank(text, at)
            if at == len(text):
                return calls
            if text[at] != ";":
                return None
            at += 1


class PythonicReader(_WholeAnswerReader):
    """`pythonic`: a Python list of calls with keyword arguments whose values are literals. Read as a
    syntax tree (ast), the values by `ast.literal_eval`: nothing of the text is ever run."""

    def _may_be_calls(self, head: str) -> bool:
        return head.startswith("[")

    def _parse(self, text: str) -> list[Call] | None:
        try:
            listed = ast.parse(text, mode="eval").body
            if not isinstance(listed, ast.List) or not listed.elts:
                return None
            calls = [self._one(c) for c in listed.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None
        return None if None in calls else calls

    def _one(self, node: ast.expr) -> Call | None:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                or any(k.arg is None for k in node.keywords):  # positional or **spread arguments: not a call
            return None
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        json.dumps(args, allow_nan=False)  # TypeError, ValueError: a value JSON has no form of (a set, bytes, inf)
        return json_call({"name": node.func.id, "arguments": args}, self.names)


_PYTHON_TAG = "<|python_tag|>"  # Llama 3's marker of a tool call (a special token: often not in the text)


def json_call(made, names: frozenset[str]) -> Call | None:
    """The call the JSON value `made` is: an object naming one of `names`, with `arguments` (or
    `parameters`) an object or a string holding one; None if it is not."""
    if not isinstance(made, dict) or made.get("name") not in names:
        return None
    args = made.get("arguments", made.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(made["name"], json.dumps(args, ensure_ascii=False))


def _skip_blank(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
