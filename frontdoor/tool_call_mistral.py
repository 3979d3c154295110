"""Tool calls in Mistral's format (tool_choice "auto" with `--tool-call-parser mistral`).

The answer is content, then `[TOOL_CALLS]` and the calls to its end, in one of two forms:

- tokenizers before v11 (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo): one JSON list of
  `{"name": "...", "arguments": {...}}` objects after a single tag;
- v11 and later (Mistral Small 3.2, Magistral, Devstral): `name[ARGS]{...}` per call, each after its
  own tag.

`[TOOL_CALLS]` and `[ARGS]` are special tokens in Mistral's vocabularies, so a request read by this parser
keeps special tokens in its text (openai_api.chat_request), as vLLM does. Streamed, content goes out as
it comes except a tail that may begin the tag; from the tag on the answer is held to its end, then given
as its calls or, if any part is not a call of the request's tools, as text (the tag included).
"""

from __future__ import annotations

import json

from frontdoor.tool_call_text import Call, json_call, partial_tag

TAG, _ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralReader:
    """One answer's text in the `mistral` format, fed piece by piece (tool_call_text.HermesReader's
    interface: `feed`, `finish` and `calls`)."""

    def __init__(self, names: frozenset[str]):
        self.names = names  # the request's tools: a call of another function makes the whole tail text
        self._buf = ""  # held: a tail that may begin the tag, or everything from the tag on
        self._tagged = False
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self._buf += text
        if self._tagged:
            return "", []
        at = self._buf.find(TAG)
        if at >= 0:
            out, self._buf, self._tagged = self._buf[:at], self._buf[at:], True
            return out, []
        keep = len(self._buf) - partial_tag(self._buf, TAG)
        out, self._buf = self._buf[:keep], self._buf[keep:]
        return out, []

    def finish(self) -> tuple[str, list[Call]]:
        held, self._buf = self._buf, ""
        calls = self._parse(held) if self._tagged else None
        if not calls:
            return held, []
        self.calls = len(calls)
        return "", calls

    def _parse(self, text: str) -> list[Call] | None:
        """The calls after the tags of `text` (which starts with one), or None if any part is not a call."""
        parts = text.split(TAG)[1:]
        if len(parts) == 1 and parts[0].lstrip().startswith(("[", "{")):  # before v11: one JSON list
            try:
                made = json.loads(parts[0])
            except ValueError:
                return None
            calls = [json_call(m, self.names) for m in (made if isinstance(made, list) else [made])]
        else:
            calls = [self._named(p) for p in parts]
        return None if not calls or None in calls else calls

    def _named(self, part: str) -> Call | None:
        """One v11 call, `name[ARGS]{...}`."""
        name, sep, args = part.partition(_ARGS)
        if not sep:
            return None
        try:
            return json_call({"name": name.strip(), "arguments": json.loads(args)}, self.names)
        except ValueError:
            return None
