"""A guide: the grammar a request's output must follow (structured output, guided decoding).

This module only describes and checks a guide's shape; imports nothing heavy. engine/guided.py
compiles it against a tokenizer and masks the logits with it at every step. A guide travels with the
request's SamplingParams, so every process that samples for the request (prefill's first token,
decode's rest, a worker that resumes it) rebuilds the same grammar state from the tokens so far.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from tandem.status import InvalidArgument

MAX_GUIDE_CHARS = 1 << 16  # a schema, regex or grammar longer than this is refused before compiling
MAX_CHOICES = 256


class GuideKind(str, enum.Enum):
    """The kinds TensorRT-LLM's Triton ensemble names in `guided_decoding_guide_type`, plus vLLM's choice."""

    JSON = "json"  # any JSON value; the text is empty
    JSON_SCHEMA = "json_schema"  # the text is a JSON schema (an object)
    REGEX = "regex"  # the whole output matches the regular expression
    EBNF_GRAMMAR = "ebnf_grammar"  # a GBNF grammar (llama.cpp's EBNF dialect, rule `root`)
    CHOICE = "choice"  # the text is a JSON list of strings; the output is exactly one of them

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Guide:
    """Constructing one checks its shape (InvalidArgument naming `guide`); whether the schema, regex or
    grammar compiles is engine/guided.py's check, made once where the request is prepared."""

    kind: GuideKind
    text: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GuideKind):
            raise InvalidArgument(f"guide type must be one of {', '.join(k.value for k in GuideKind)}, "
                                  f"got {self.kind!r}", "guide")
        if not isinstance(self.text, str) or len(self.text) > MAX_GUIDE_CHARS:
            raise InvalidArgument(f"a {self.kind} guide must be text of at most {MAX_GUIDE_CHARS} characters",
                                  "guide")
        if self.kind is GuideKind.JSON:
            if self.text:
                raise InvalidArgument("a json guide takes no text (any JSON value); send a json_schema guide "
                                      "to constrain its shape", "guide")
        elif not self.text:
            raise InvalidArgument(f"a {self.kind} guide needs its text (the schema, regex, grammar or choices)",
                                  "guide")
        elif self.kind is GuideKind.JSON_SCHEMA and not isinstance(_json(self.text), dict):
            raise InvalidArgument("a json_schema guide must be a JSON object (a JSON schema)", "guide")
        elif self.kind is GuideKind.CHOICE:
            self.choices  # checks the list

    @property
    def choices(self) -> list[str]:
        """A choice guide's strings: 1..MAX_CHOICES non-empty strings."""
        v = _json(self.text)
        if not isinstance(v, list) or not 1 <= len(v) <= MAX_CHOICES or not all(isinstance(s, str) and s for s in v):
            raise InvalidArgument(f"a choice guide must be a JSON list of 1..{MAX_CHOICES} non-empty strings",
                                  "guide")
        return v


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidArgument("the guide is not valid JSON", "guide") from None
