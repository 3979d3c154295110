"""What each watcher of a worker learns about its prefix cache: every change, or a snapshot.

The allocator keeps one log of hash changes, drained destructively. A worker may have several watchers
(one per orchestrator replica, and one per reconnect), and each must see every change or a full set
instead. So the worker drains the allocator into this feed (`collect`, under the lock that guards the
allocator), and the feed keeps, per subscriber, the net change since that subscriber's last report,
plus a mirror of the whole set, which is what a subscriber gets when it is new or fell too far behind.

A subscriber's report (`take`) is (stored, removed, resync): with resync False, apply the two disjoint
lists to what it knew; with resync True, `stored` is the whole set and replaces it.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

from engine.page_allocator import PageAllocator


@dataclass
class _Subscriber:
    net: dict[bytes, bool] = field(default_factory=dict)  # hash -> held now, since its last report
    resync: bool = True  # its next report is the whole set


class CacheFeed:
    def __init__(self, capacity: int):
        """`capacity`: changes kept per subscriber between reports; past it, its next report is a snapshot."""
        if capacity < 1:
            raise ValueError(f"a cache feed needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.held: dict[bytes, None] = {}  # the allocator's set as of the last collect, oldest first
        self._subs: dict[Hashable, _Subscriber] = {}
        self._lock = threading.Lock()

    def subscribe(self, key: Hashable) -> None:
        with self._lock:
            self._subs[key] = _Subscriber()

    def unsubscribe(self, key: Hashable) -> None:
        with self._lock:
            self._subs.pop(key, None)

    def collect(self, allocator: PageAllocator) -> None:
        """Move the allocator's changes into every subscriber's pending report. The caller holds the
        allocator's lock; an overflowed allocator log is healed by diffing its snapshot with the mirror."""
        if allocator.resync_needed:
            now = allocator.snapshot()
            stored = [h for h in now if h not in self.held]
            gone = self.held.keys() - set(now)
            removed = [h for h in self.held if h in gone]
        else:
            stored, removed = allocator.drain_events()
        if not stored and not removed:
            return
        with self._lock:
            for h in removed:
                self.held.pop(h, None)
            for h in stored:
                self.held[h] = None
            for sub in self._subs.values():
                if sub.resync:
                    continue
                sub.net.update((h, False) for h in removed)
                sub.net.update((h, True) for h in stored)
                if len(sub.net) > self.capacity:
                    sub.net.clear()
                    sub.resync = True

    def take(self, key: Hashable) -> tuple[list[bytes], list[bytes], bool]:
        """The subscriber's report since its last one (see the module docstring); clears it."""
        with self._lock:
            sub = self._subs.get(key)
            if sub is None:
                return [], [], False
            if sub.resync:
                sub.resync = False
                sub.net.clear()
                return list(self.held), [], True
            stored = [h for h, held in sub.net.items() if held]
            removed = [h for h, held in sub.net.items() if not held]
            sub.net.clear()
            return stored, removed, False
