"""Subscribers to a worker's state (the orchestrator's Watch): each gets the worker's stats whenever
something changed, and at least every `heartbeat_s` as a sign of life. A worker that stops sending
is stalled or gone: that is how the orchestrator notices a stopped process (SIGSTOP) in seconds.
A watch names its orchestrator (`owner`); when the last watch of one goes, `on_owner_gone(owner)`, and
when one begins, `on_owner_back(owner)`.

A Watch call ends after `renew_after` pushes (tandem/call_renewal.py): its last reply is
marked `renew`, and the orchestrator watches again at once. Triton keeps every response of a request
until the request ends, so one call lasting as long as its orchestrator would grow the worker's server
by about a kilobyte per push, for good (measured before renewals: 3.0 KB per request in a prefill
worker's server, 6.3 KB in a decode worker's; scripts/worker_memory.py). A renewed watch leaves as
any other (its owner's last watch going starts the LoRA set's grace, its return ends it) and the next
begins with the whole prefix cache.

Heartbeats come from a thread of their own, not from the worker's loop: a long model pass (a 4k-token
prompt on a CPU takes many seconds) must not look like a stall. Changes are pushed by the loop.

With a prefix cache, each watcher's stats also carry the cache changes it has not seen yet (its own
report from engine/workers/cache_feed.py): reports to one watcher are taken and sent in order, one
push at a time, so a watcher never applies an older report after a newer one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.workers.cache_feed import CacheFeed
from engine.workers.loop import run_or_report
from engine.workers.sink import Responder
from tandem.call_renewal import WATCH_RENEW_AFTER, watch_pushes
from tandem.status import Cancelled, Unavailable


@dataclass
class _Watcher:
    sink: Responder
    heartbeat_s: float
    due: float
    owner: str = ""  # the watching orchestrator ("": it did not say)
    renew_after: int = WATCH_RENEW_AFTER  # pushes before its call ends with a `renew` reply
    pushes: int = 0


class Watchers:
    def __init__(self, stats: Callable[[], object], clock=time.monotonic, feed: CacheFeed | None = None):
        """`stats()` must collect the allocator's changes into `feed` (under the worker's lock) first."""
        self.stats, self.clock, self.feed = stats, clock, feed
        self._cond = threading.Condition()
        self._sending = threading.Lock()  # one push at a time: reports reach each watcher in order
        self._all: list[_Watcher] = []
        self._closed = False
        self.on_crash: Callable[[BaseException], None] | None = None  # set by the worker's launch (see _beat)
        self.on_owner_gone: Callable[[str], None] | None = None  # the LoRA set's expiry (adapter_set.py)
        self.on_owner_back: Callable[[str], None] | None = None  # ... and its end
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def add(self, sink: Responder, heartbeat_s: float, owner: str = "", renew_after: int = WATCH_RENEW_AFTER) -> None:
        """A new watch; its call ends after `renew_after` pushes (tandem/call_renewal.py: watch_pushes)."""
        w = _Watcher(sink, max(0.05, heartbeat_s), 0.0, owner, watch_pushes(renew_after))  # the first push: at once
        if self.feed is not None:
            self.feed.subscribe(id(w))  # its first report is the whole cache
        if owner and self.on_owner_back is not None:
            self.on_owner_back(owner)
        with self._cond:
            self._all.append(w)
            self._cond.notify()

    def push(self, force: bool = False) -> None:
        """Send stats to every watcher due for a heartbeat (all of them when `force`): the last of a call's
        `renew_after` ends it; drop the gone."""
        with self._sending:
            now = self.clock()
            with self._cond:
                due = [w for w in self._all if force or now >= w.due]
            if not due:
                return
            stats = self.stats()  # outside our lock: it takes the worker's
            renewed = []  # (watcher, its last report)
            for w in due:
                w.pushes += 1
                if w.pushes >= w.renew_after:
                    renewed.append((w, replace(self._report(stats, w), renew=True)))
                else:
                    w.sink.send(self._report(stats, w))
                w.due = now + w.heartbeat_s
            with self._cond:
                gone = [w for w in self._all if w.sink.cancelled()]
                ended = gone + [w for w, _ in renewed if w not in gone]
                self._all = [w for w in self._all if w not in ended]
                left = {w.owner for w in ended} - {w.owner for w in self._all} - {""}  # their last watch went
        for owner in left:  # before a renewed call ends: its owner's next watch (back) comes after
            if self.on_owner_gone is not None:
                self.on_owner_gone(owner)
        for w in ended:
            if self.feed is not None:
                self.feed.unsubscribe(id(w))
        for w, last in renewed:
            if w not in gone:
                w.sink.send(last, final=True)
        for w in gone:
            w.sink.fail(Cancelled("the watcher went away"))  # the final reply retires the request

    def _report(self, stats, w: _Watcher):
        """The stats with this watcher's own prefix-cache changes (hex hashes, see tandem/wire.py)."""
        if self.feed is None:
            return stats
        stored, removed, resync = self.feed.take(id(w))
        return replace(stats, stored=[h.hex() for h in stored], removed=[h.hex() for h in removed], resync=resync)

    def _beat(self) -> None:
        """The heartbeat thread. If it dies of an exception (a bug), `on_crash(error)`: without heartbeats
        a working worker looks stalled, so a server ends itself at once to be replaced (as for its loop,
        engine/workers/loop.py) rather than after stall_s + stall_restart_s."""
        run_or_report(self._beat_until_closed, self)

    def _beat_until_closed(self) -> None:
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
