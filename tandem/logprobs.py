"""A logprob report for one position, as the engine makes it and the wire carries it (imports nothing heavy)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """The chosen token's log-probability and the top alternatives, most likely first (ids and
    logprobs side by side; as many as the request's top_logprobs asked for). `rank`: 1 + how many
    tokens are more likely than the chosen one (vLLM's), on prompt reports; None where not computed."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int | None = None
