"""The two roles an engine can be built for, and the co-located baseline role."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """Which phase of generation an engine (and the Triton model serving it) runs."""

    PREFILL = "prefill"  # reads whole prompts, writes their KV pages, yields the first token
    DECODE = "decode"  # owns a KV pool, adds one token per step to a running batch

    @classmethod
    def parse(cls, text: str) -> "Role":
        try:
            return cls(text.strip().lower())
        except ValueError:
            allowed = ", ".join(r.value for r in cls)
            raise ValueError(f"unknown role {text!r}; allowed roles: {allowed}") from None
