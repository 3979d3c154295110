"""Subscribers to a worker's state (the orchestrator's Watch): each gets the worker's stats whenever
something changed, and at least every `heartbeat_s` as a sign of life. A worker that stops sending
is stalled or gone: that is how the orchestrator notices a stopped process (SIGSTOP) in seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.workers.sink import Responder
from tandem.status import Cancelled, Unavailable


@dataclass
class _Watcher:
    sink: Responder
    heartbeat_s: float
    due: float


class Watchers:
    def __init__(self, stats: Callable[[], object], clock=time.monotonic):
        self.stats, self.clock = stats, clock
        self._lock = threading.Lock()
        self._all: list[_Watcher] = []

    def add(self, sink: Responder, heartbeat_s: float) -> None:
        with self._lock:
            self._all.append(_Watcher(sink, max(0.05, heartbeat_s), 0.0))  # the first push goes at once

    def push(self, force: bool = False) -> None:
        """Send stats to every watcher due for a heartbeat (all of them when `force`); drop the gone."""
        now = self.clock()
        with self._lock:
            due = [w for w in self._all if force or now >= w.due]
        if not due:
            return
        stats = self.stats()  # outside our lock: it takes the worker's
        for w in due:
            w.sink.send(stats)
            w.due = now + w.heartbeat_s
        with self._lock:
            gone = [w for w in self._all if w.sink.cancelled()]
            self._all = [w for w in self._all if w not in gone]
        for w in gone:
            w.sink.fail(Cancelled("the watcher went away"))  # the final reply retires the request

    def next_due(self) -> float | None:
        with self._lock:
            return min((w.due for w in self._all), default=None)

    def close(self) -> None:
        """The worker is stopping: end every subscription (the orchestrator sees the worker leave)."""
        with self._lock:
            for w in self._all:
                w.sink.fail(Unavailable("the worker is shutting down"))
            self._all.clear()
