"""Subscribers to a worker's state (the orchestrator's Watch): each gets the worker's stats whenever
something changed, and at least every `heartbeat_s` as a sign of life. A worker that stops sending
is stalled or gone: that is how the orchestrator notices a stopped process (SIGSTOP) in seconds.

Heartbeats come from a thread of their own, not from the worker's loop: a long model pass (a 4k-token
prompt on a CPU takes many seconds) must not look like a stall. Changes are pushed by the loop.
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
        self._cond = threading.Condition()
        self._all: list[_Watcher] = []
        self._closed = False
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def add(self, sink: Responder, heartbeat_s: float) -> None:
        with self._cond:
            self._all.append(_Watcher(sink, max(0.05, heartbeat_s), 0.0))  # the first push goes at once
            self._cond.notify()

    def push(self, force: bool = False) -> None:
        """Send stats to every watcher due for a heartbeat (all of them when `force`); drop the gone."""
        now = self.clock()
        with self._cond:
            due = [w for w in self._all if force or now >= w.due]
        if not due:
            return
        stats = self.stats()  # outside our lock: it takes the worker's
        for w in due:
            w.sink.send(stats)
            w.due = now + w.heartbeat_s
        with self._cond:
            gone = [w for w in self._all if w.sink.cancelled()]
            self._all = [w for w in self._all if w not in gone]
        for w in gone:
            w.sink.fail(Cancelled("the watcher went away"))  # the final reply retires the request

    def _beat(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    due = min((w.due for w in self._all), default=None)
                    wait = None if due is None else due - self.clock()
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._closed:
                    return
            self.push()

    def close(self) -> None:
        """The worker is stopping: end every subscription (the orchestrator sees the worker leave)."""
        with self._cond:
            self._closed = True
            watchers, self._all = self._all, []
            self._cond.notify()
        for w in watchers:
            w.sink.fail(Unavailable("the worker is shutting down"))
