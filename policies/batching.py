"""Which waiting prompts an engine that decodes and prefills in one batch takes into its next pass.

Two policies (engine/scheduler.py runs them; planner/sim/colocated.py simulates them):
- prefill-first: a pass of the oldest waiting prompts, taken in order while the pass stays within
  `pass_tokens` (a longer prompt runs alone) and the batch has room (`admit`); the running decodes
  pause for it;
- chunked: every pass decodes one token of each running sequence and gives up to `chunk_tokens`
  prompt tokens to the admitted prompts, oldest first (`chunk_split`).
"Oldest" is the waiting queue's order (`enqueue`): arrival, or with priority scheduling the lowest
priority value first, arrival among equals.
The batch cap counts running sequences plus prompts being prefilled: it is the model repository's
`max_batch_size`.
"""

from __future__ import annotations

from collections.abc import Callable, MutableSequence, Sequence
from typing import TypeVar

T = TypeVar("T")


def enqueue(waiting: MutableSequence[T], item: T, priority: Callable[[T], int]) -> None:
    """Queue a prompt: behind every waiting one of its priority or a lower value (arrival order among
    equals; all equal, first come first served), ahead of those of a higher value."""
    at = len(waiting)
    while at and priority(waiting[at - 1]) > priority(item):
        at -= 1
    waiting.insert(at, item)


def admit(waiting: Sequence[T], size: Callable[[T], int], budget: float, room: int) -> int:
    """How many of the oldest `waiting` prompts join the next pass: in order, at most `room`, while
    their summed `size` stays within `budget` (the first one always fits)."""
    n, tokens = 0, 0
    while n < min(room, len(waiting)):
        tokens += size(waiting[n])
        if n and tokens > budget:
            break
        n += 1
    return n


def chunk_split(todo: Sequence[int], budget: int) -> list[int]:
    """Prompt tokens each admitted prompt (oldest first, `todo` tokens left each) computes in one
    chunked pass: in order, until `budget` is spent. As long as `todo` or shorter."""
    out = []
    for n in todo:
        if budget == 0:
            break
        out.append(min(budget, n))
        budget -= out[-1]
    return out
