"""A worker's loop thread: it runs while there is work and otherwise sleeps until it is woken (a call
arrived) or its earliest deadline is due; no fixed-interval wake-ups, no spinning.

`Deadlines` is the heap the loop waits on: keys with a due time; re-arming a key replaces its time.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable


class Deadlines:
    """Keys due at a time. Lazy deletion: a re-armed or cancelled key's old heap entry is skipped."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._heap: list[tuple[float, int, Hashable]] = []
        self._when: dict[Hashable, float] = {}
        self._seq = itertools.count()

    def at(self, when: float, key: Hashable) -> None:
        self._when[key] = when
        heapq.heappush(self._heap, (when, next(self._seq), key))

    def after(self, seconds: float, key: Hashable) -> None:
        self.at(self.clock() + seconds, key)

    def armed(self, key: Hashable) -> bool:
        return key in self._when

    def cancel(self, key: Hashable) -> None:
        self._when.pop(key, None)

    def due(self) -> list[Hashable]:
        """Keys whose time has come (each once), earliest first."""
        now, out = self.clock(), []
        while self._heap and self._heap[0][0] <= now:
            when, _, key = heapq.heappop(self._heap)
            if self._when.get(key) == when:
                del self._when[key]
                out.append(key)
        return out

    def next(self) -> float | None:
        while self._heap and self._when.get(self._heap[0][2]) != self._heap[0][0]:
            heapq.heappop(self._heap)  # stale entry
        return self._heap[0][0] if self._heap else None


def run_or_report(run: Callable[[], None], owner) -> None:
    """A worker thread's body: `run()`, and if it raises (a bug), the error goes to `owner.on_crash`, read
    then (None: it is raised, and the thread dies with it)."""
    try:
        run()
    except BaseException as e:
        if owner.on_crash is None:
            raise
        owner.on_crash(e)


class Loop:
    """Runs `body()` on a daemon thread. `body` returns True while it has more work to do right away;
    when it returns False the thread sleeps until `wake()` or the time `next_due()` returns.

    `start(on_crash)`: `on_crash(error)` is called if `body` raises (a bug). The thread is the worker:
    without it requests hang while the heartbeats go on, so a server passes a handler that ends the
    process (engine/triton/common.py:end_server) and its supervisor replaces it."""

    def __init__(self, body: Callable[[], bool], next_due: Callable[[], float | None], name: str,
                 clock=time.monotonic):
        self.body, self.next_due, self.clock = body, next_due, clock
        self.on_crash: Callable[[BaseException], None] | None = None
        self._cond = threading.Condition()
        self._woken = False
        self._stop = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, on_crash: Callable[[BaseException], None] | None = None) -> "Loop":
        self.on_crash = on_crash
        self.thread.start()
        return self

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify()

    def _run(self) -> None:
        run_or_report(self._serve, self)

    def _serve(self) -> None:
        while not self._stop:
            if self.body():
                continue
            with self._cond:
                while not (self._woken or self._stop):
                    due = self.next_due()
                    timeout = None if due is None else due - self.clock()
                    if timeout is not None and timeout <= 0:
                        break
                    self._cond.wait(timeout)
                self._woken = False

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self.thread.is_alive():
            self.thread.join(timeout=timeout_s)
