"""How a prefill worker fills its passes.

A pass computes at most `pass_tokens` prompt tokens. It is either
- a packed pass of whole prompts: the first waiting prompt, then the shortest others that still
  fit (`pack`); or
- the next chunk of one prompt longer than a pass: `chunk_tokens` tokens, a whole number of KV
  pages, so every chunk starts on a page boundary (`chunk_tokens`).
When long and short prompts both wait, passes alternate (`PassTurn`): a short prompt never waits
for a whole long prompt, and a long prompt always advances.
"First" is the order of `in_turn`: arrival, or with priority scheduling the lowest priority value
first, arrival among equals (vLLM's priority policy); the fillers of a packed pass go by priority too,
the shortest first within one. The long prompt chunked next is the first in turn, unless one is part
way through (`next_long`).

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


def in_turn(waiting: Sequence[T], priority: Callable[[T], int]) -> list[T]:
    """`waiting` (in arrival order) in the order it is served: the lowest priority value first, arrival
    order among equals. All priorities equal (first come, first served): arrival order."""
    return sorted(waiting, key=priority)  # stable: the older first on ties


def next_long(longs: Sequence[T], priority: Callable[[T], int], started: Callable[[T], bool]) -> T:
    """The long prompt whose chunk runs next, of `longs` (in arrival order; not empty): one part way
    through keeps its turn (its pages are held: another waiting for pool room behind it could never get
    the room, whatever its priority), else the first in turn (in_turn)."""
    return min(in_turn(longs, priority), key=lambda it: not started(it))  # min: the first of the least key


def pack(waiting: Sequence[T], size: Callable[[T], int], budget: int,
         priority: Callable[[T], int] = lambda _: 0) -> list[T]:
    """The prompts of one packed pass, from `waiting` in turn (in_turn; not empty).

    The first is always taken (even when alone it exceeds `budget`); then the others by priority and,
    within one, shortest first (arrival order on ties), each that still fits within `budget`.
    """
    group, room = [waiting[0]], budget - size(waiting[0])
    for item in sorted(waiting[1:], key=lambda it: (priority(it), size(it))):  # stable: the older first on ties
        n = size(item)
        if n <= room:  # a larger one of a lower priority class may not fit where a smaller one later does
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
