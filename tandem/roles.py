"""The roles a worker can serve, as typed identities: the two disaggregated roles and the co-located one.

A role is carried on every worker spec and state (ops/local_workers.py, control/fleet.py); nothing parses
it from a worker's name. The enums here are text enums: each member is equal to, hashes like, formats as
and serializes to its string, so the deployment file, CLI choices, Triton model names and JSON keep the
same words.
"""

from __future__ import annotations

import enum


class TextEnum(str, enum.Enum):
    """A str enum that prints as its value (f-strings, str(), json) on every Python version."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def parse(cls, text: str, what: str | None = None):
        """The member spelled `text` (any case, surrounding blanks ignored); ValueError naming the allowed ones."""
        try:
            return cls(text.strip().lower())
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            what = what or cls.__name__.lower()
            raise ValueError(f"unknown {what} {text!r}; allowed: {allowed}") from None


class Role(TextEnum):
    """Which phase of generation a worker (and the Triton model serving it) runs."""

    PREFILL = "prefill"  # reads whole prompts, writes their KV pages, yields the first token
    DECODE = "decode"  # owns a KV pool, adds one token per step to a running batch
    GENERATE = "generate"  # co-located baseline: prefills and decodes its own requests in one pool

    @classmethod
    def parse(cls, text: str, what: str | None = "role") -> "Role":
        return super().parse(text, what)


ENGINE_ROLES = (Role.PREFILL, Role.DECODE)  # the roles engines are built for (generate runs the prefill engine)
