"""The simulated clock: a heap of timed callbacks, run in time order.

Events at the same instant run in the order they were scheduled, except that `soon` callbacks (a
worker deciding what to run next) wait until every ordinary event of that instant has run. So
requests arriving together, or a step ending while a request arrives, are all seen before a worker
forms its next pass, as a real worker's queue would hold them all by then.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

_NOW, _SOON = 0, 1


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._order = itertools.count()

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run fn(*args) at simulated time t (never before now)."""
        if t < self.now:
            raise ValueError(f"cannot schedule an event at {t} before the current time {self.now}")
        heapq.heappush(self._heap, (t, _NOW, next(self._order), fn, args))

    def soon(self, fn: Callable, *args) -> None:
        """Run fn(*args) at the current time, after all ordinary events of this instant."""
        heapq.heappush(self._heap, (self.now, _SOON, next(self._order), fn, args))

    def run(self) -> None:
        """Run events until none are left."""
        heap = self._heap
        while heap:
            t, _, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)
