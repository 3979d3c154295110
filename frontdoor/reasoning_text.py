"""Reasoning parsers (`front_door.reasoning_parser`, `tandem serve --reasoning-parser`, as vLLM's): a
thinking model's answer read as its reasoning, written between `<think>` and `</think>`, and its content.

- `deepseek_r1`: the chat template opens the thinking (its prompt ends with `<think>`), so the answer is
  reasoning from its first token until `</think>` (a `<think>` the model writes again first is dropped).
- `qwen3`: the answer is reasoning only when it starts with `<think>` (whitespace before it aside),
  until `</think>`; an answer that does not is all content (thinking switched off, or not used).

The content is the text after `</think>`, the whitespace right after the tag dropped. An answer that ends
before `</think>` (cut by max_tokens) is all reasoning. Later tags are content as written. The split is
the same whole and streamed: a streamed piece that may be the start of a tag is held until it is known.
"""

from __future__ import annotations

import enum

from frontdoor import openai_api as oa
from frontdoor.openai_tools import ToolCallShape

START, END = "<think>", "</think>"
OPENED = {"deepseek_r1": True, "qwen3": False}  # parser -> whether the answer starts inside its reasoning
PARSER_NAMES = tuple(OPENED)


class _State(enum.Enum):
    START = "start"  # nothing but what may be the opening tag so far
    REASONING = "reasoning"
    CONTENT = "content"


class ThinkSplitter:
    """One answer's text, piece by piece, as (reasoning, content) pieces."""

    def __init__(self, opened: bool):
        self.opened = opened
        self.state = _State.START
        self.held = ""  # text not yet released: what may be a tag
        self.thought = False  # whether the answer has a reasoning part (even an empty one)
        self.trim = False  # dropping the whitespace after </think>, until the content's first other text

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that `text` (the answer's next piece) releases."""
        self.held += text
        reasoning = ""
        if self.state is _State.START:
            lead = self.held.lstrip()
            if len(lead) < len(START) and START.startswith(lead):
                return "", ""  # may yet be the opening tag
            if lead.startswith(START):
                self.held = lead[len(START):]
                self._enter(_State.REASONING)
            else:
                self._enter(_State.REASONING if self.opened else _State.CONTENT)
        if self.state is _State.REASONING:
            end = self.held.find(END)
            if end < 0:
                cut = len(self.held) - _tag_start(self.held)
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held = self.held[:end], self.held[end + len(END):]
            self.state, self.trim = _State.CONTENT, True
        content, self.held = self.held, ""
        if self.trim:  # the whitespace right after </think>, whichever pieces it comes in
            content = content.lstrip()
            self.trim = not content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held once the answer ended, as (reasoning, content)."""
        held, self.held = self.held, ""
        if self.state is _State.START:  # shorter than the tag: content, or the opened reasoning
            self._enter(_State.REASONING if self.opened else _State.CONTENT)
        return (held, "") if self.state is _State.REASONING else ("", held)

    def whole(self, text: str) -> tuple[str | None, str]:
        """A whole answer as (its reasoning, None if it has none; its content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2 if self.thought else None), c1 + c2

    def _enter(self, state: _State) -> None:
        self.state = state
        self.thought = self.thought or state is _State.REASONING


class ThoughtTokens:
    """Counts one answer's reasoning tokens from its deltas (frontdoor.core.Delta): the tokens made until
    its reasoning ended, the one whose text completes `</think>` included (all of them when it never
    does; none for an answer with no reasoning). A token whose text is held back and released later
    (a partial character, a possible stop string) counts with the delta that releases it."""

    def __init__(self, parser: str):
        self.split = ThinkSplitter(OPENED[parser])
        self.count = 0
        self._undecided = 0  # tokens before it is known whether the answer opens with <think>

    def add(self, delta) -> None:
        if self.split.state is _State.CONTENT:
            return
        self.split.feed(delta.text)
        made = delta.token is not None
        if self.split.state is _State.START:
            self._undecided += made
        elif self.split.thought:  # reasoning, or the delta that ended it
            self.count += made + self._undecided
            self._undecided = 0
        else:  # the answer is content: what was undecided was content too
            self._undecided = 0

    def total(self) -> int:
        """The count once the answer ended (an answer still undecided ends as its parser reads it)."""
        return self.count + (self._undecided if self.split.opened else 0)


def _tag_start(text: str) -> int:
    """How many of `text`'s last characters may be the start of the closing tag (held back)."""
    for n in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-n:]):
            return n
    return 0


def chat_shape(parsed: oa.Parsed, reasoning_parser: str | None):
    """How a chat request's answers are shaped: as text (openai_api.chat_body), as tool calls where it has
    tools, and split into reasoning and content under a reasoning parser, except answers under a guide
    (structured output, a forced call): the guide shaped all of the answer, so all of it is content."""
    shape = oa.chat_body if parsed.tools is None else ToolCallShape(parsed.tools, oa.chat_body)
    if reasoning_parser is None or parsed.answers[0].guide is not None:
        return shape
    return ReasoningShape(reasoning_parser, shape)


def _named(reasoning: str) -> dict:
    """The reasoning under vLLM's name and its older one (clients read one or the other)."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


class ReasoningShape:
    """A chat shape (`inner`: openai_api.chat_body or a ToolCallShape) for a server with a reasoning
    parser: each answer's reasoning goes beside its message (`reasoning`, and `reasoning_content` as
    older clients read it), and only the content reaches `inner` (so only it is read for calls)."""

    def __init__(self, parser: str, inner):
        self.parser, self.opened, self.inner = parser, OPENED[parser], inner
        self._splitters: dict[int, ThinkSplitter] = {}  # streaming: each choice's

    def thoughts(self) -> ThoughtTokens:
        """A counter of one answer's reasoning tokens, read as this shape reads its text."""
        return ThoughtTokens(self.parser)

    def __call__(self, rid: str, model: str, text: str, reason: str | None, usage_: dict | None, chunk: bool,
                 first: bool = False, logprobs: dict | None = None, index: int = 0) -> dict | None:
        """A reply or SSE event as `inner`'s, with the reasoning beside; None while nothing can go out yet."""
        if not chunk:
            split = ThinkSplitter(self.opened)
            reasoning, content = split.whole(text)
            body = self.inner(rid, model, content, reason, usage_, chunk, first, logprobs, index)
            if reasoning is not None:
                message = body["choices"][0]["message"]
                message |= _named(reasoning) | {"content": message.get("content") or None}
            return body
        if not (text or reason):  # no piece of an answer (the usage chunk after them all)
            return self.inner(rid, model, text, reason, usage_, chunk, first, logprobs, index)
        split = self._splitters.setdefault(index, ThinkSplitter(self.opened))
        reasoning, content = split.feed(text)
        if reason:
            more = split.finish()
            reasoning, content = reasoning + more[0], content + more[1]
            del self._splitters[index]
        if not (reasoning or content or reason):
            return None  # held: what may be a tag
        body = self.inner(rid, model, content, reason, usage_, chunk, first, logprobs, index)
        if not reasoning:
            return body
        if body is None:  # `inner` holds the content (what may be a call): the reasoning goes out alone
            body = oa.chat_body(rid, model, "", None, usage_, chunk, first, logprobs, index)
        delta = body["choices"][0]["delta"]
        if not delta.get("content"):
            delta.pop("content", None)
        delta |= _named(reasoning)
        return body
