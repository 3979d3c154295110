"""Which request a request refused for KV pages preempts. Used by control/waiting_room.py (`make_room`)
and planner/sim/waiting.py (`Holders`).

A request of priority P preempts the least urgent holder of a worse priority (> P): the worst priority,
then the latest to arrive. The callers look first among the holders on the worker that refused the
request, then among all; first come, first served (every priority equal) preempts nobody.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

H = TypeVar("H")


def least_urgent(holders: Iterable[H], priority: int, rank: Callable[[H], tuple[int, ...]]) -> H | None:
    """Of `holders` whose priority (`rank(h)[0]`) is worse than `priority`, the one with the largest
    `rank` (priority, then arrival order: later is larger); None if none is worse."""
    return max((h for h in holders if rank(h)[0] > priority), key=rank, default=None)
