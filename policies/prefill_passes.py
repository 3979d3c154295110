"""How a prefill worker fills its passes.

A pass computes at most `pass_tokens` prompt tokens. It is either
- a packed pass of whole prompts: the oldest waiting prompt, then the shortest others that still
  fit (`pack`); or
- the next chunk of one prompt longer than a pass: `chunk_tokens` tokens, a whole number of KV
  pages, so every chunk starts on a page boundary (`chunk_tokens`).
When long and short prompts both wait, passes alternate (`PassTurn`): a short prompt never waits
for a whole long prompt, and a long prompt always advances.

Used by engine/workers/prefill_worker.py (sizes: tokens still to compute, the cached prefix left
out) and planner/sim/sim_prefill.py (sizes: prompt lengths).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def chunk_tokens(pass_tokens: int, tokens_per_page: int) -> int:
    """Tokens in one chunk of a long prompt: `pass_tokens` rounded down to whole pages (at least one)."""
    return max(tokens_per_page, pass_tokens // tokens_per_page * tokens_per_page)


def pack(waiting: Sequence[T], size: Callable[[T], int], budget: int) -> list[T]:
    """The prompts of one packed pass, from `waiting` in arrival order (not empty).

    The oldest is always taken (even when alone it exceeds `budget`); then the others, shortest
    first (arrival order on ties), while the running total stays within `budget`.
    """
    group, room = [waiting[0]], budget - size(waiting[0])
    for item in sorted(waiting[1:], key=size):  # sorted is stable: the older first on ties
        n = size(item)
        if n > room:
            break  # ascending sizes: nothing after this one fits either
        group.append(item)
        room -= n
    return group


class PassTurn:
    """Whose turn the next pass is when long and short prompts both wait (long first)."""

    def __init__(self) -> None:
        self._long_next = False

    def take_long(self, longs_waiting: bool, shorts_waiting: bool) -> bool:
        """True: the next pass is the oldest long prompt's next chunk; False: a packed pass (or nothing
        waits). Records the choice: after a long pass, shorts go next, and the other way round."""
        long = longs_waiting and (self._long_next or not shorts_waiting)
        self._long_next = not long
        return long
