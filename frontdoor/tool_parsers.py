"""The tool-call parsers a deployment may name (`front_door.tool_call_parser`, `tandem serve
--tool-call-parser`): name -> reader of one answer's text in that model family's own call format."""

from __future__ import annotations

import secrets
import string

from frontdoor.tool_call_mistral import MistralReader
from frontdoor.tool_call_text import HermesReader, Llama3JsonReader, PythonicReader

CallReader = HermesReader | Llama3JsonReader | PythonicReader | MistralReader
PARSERS: dict[str, type[CallReader]] = {"hermes": HermesReader, "llama3_json": Llama3JsonReader,
                                        "pythonic": PythonicReader, "mistral": MistralReader}
PARSER_NAMES = tuple(PARSERS)
KEEPS_SPECIAL_TOKENS = frozenset({"mistral"})  # its markers are special tokens: the text must keep them


def reader(parser: str, names: frozenset[str]) -> CallReader:
    """A reader of one answer in the format `parser` (one of PARSER_NAMES) that finds calls of `names`."""
    return PARSERS[parser](names)


def call_id(parser: str) -> str:
    """A new id for a call the reply names: OpenAI's `call_` and 24 hex digits; 9 letters and digits under
    the `mistral` parser, the only form Mistral's chat templates take back in the conversation."""
    if parser == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


_ALNUM = string.ascii_letters + string.digits
