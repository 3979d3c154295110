"""Tool calls a model writes in its own words (tool_choice "auto"): which of its text is a call.

With "auto" the model decides between answering and calling, so nothing forces the answer's shape:
the calls are read out of the text afterwards, by a parser of the model's own call format, named by
the deployment (`front_door.tool_call_parser`, as vLLM's `--tool-call-parser`). One format is known:

- `hermes` (Hermes 2 Pro, Qwen 2.5 and 3, SmolLM3 and others): each call is a block
  `<tool_call>{"name": "...", "arguments": {...}}</tool_call>` anywhere in the answer.

A block is a call only if it is that JSON object naming one of the request's tools (`arguments` an
object, or a string holding one); any other block stays text. The text outside the blocks is the
answer's content, its whitespace around the calls dropped; an answer without a call is its text,
unchanged. Streamed, content goes out as it comes, except what may be the start of a block (a prefix
of `<tool_call>`) or whitespace that may precede one; a call goes out whole once its block closed. A
block left open when the answer ends (cut short by max_tokens) is text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PARSERS = ("hermes",)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the arguments as a JSON object's text


class CallReader:
    """One answer's text, fed piece by piece: what of it is content and which calls it made."""

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
            keep = _partial_open(self._buf)  # the tail that may become "<tool_call>"
            out.append(self._content(self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(out), calls

    def finish(self) -> str:
        """The content still held once the answer ended: an open block's text, and trailing whitespace
        unless a call was made."""
        held = self._buf
        if self._in_call:  # cut short: the block is text, with the whitespace before it
            held, self._blank = _OPEN + held, self._before
        self._buf, self._in_call = "", False
        out = self._content(held)
        if not self.calls:
            out += self._blank
        self._blank = ""
        return out

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
            made = json.loads(body)
        except ValueError:
            return None
        if not isinstance(made, dict) or made.get("name") not in self.names:
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


def _partial_open(text: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of "<tool_call>"."""
    for n in range(min(len(text), len(_OPEN) - 1), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0
