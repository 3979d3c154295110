"""Least-loaded routing: which decode worker reserves a request's pages, which prefill worker takes
its prompt, and which worker is asked when none has room. Used by control/router.py (LeastLoaded, and
KvAware's prefill choice) and by planner/sim (disaggregated.py, replicas.py).

Workers are compared by what the caller passes in; ties go to the earlier worker in the given
order (callers order them by name, or by index in the simulator).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

W = TypeVar("W")


def least_loaded_decode(workers: Sequence[W], *, fits: Callable[[W], bool], running: Callable[[W], int],
                        pages_free: Callable[[W], int]) -> W | None:
    """Of the workers with room for the request (`fits`), the one streaming the fewest requests, then
    the one with the most free pages; None when no worker has room."""
    room = [w for w in workers if fits(w)]
    return min(room, key=lambda w: (running(w), -pages_free(w))) if room else None


def most_free(workers: Sequence[W], pages_free: Callable[[W], int]) -> W:
    """The worker asked when none has room for the request (`workers` not empty): the one with the most
    free pages. It takes the request if pages came free meanwhile, or answers OUT_OF_PAGES; a request it
    refuses preempts a less urgent one there first (policies/preemption.py)."""
    return max(workers, key=pages_free)


def least_queued_prefill(workers: Sequence[W], queued: Callable[[W], int]) -> W:
    """The prefill worker with the fewest prompt tokens queued or in its pass (`workers` not empty)."""
    return min(workers, key=queued)
