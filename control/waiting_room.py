"""The requests waiting for the fleet to change (full pools, no routable worker), in priority order.

A request refused for pages (OUT_OF_PAGES) or finding no routable worker sleeps until the fleet
changes (control/fleet.py `wait_change`), then tries again. With `--scheduling-policy priority` it must
not lose the freed pages to a request of a worse priority: after a change, only the waiters of the best
priority waiting try again; the others hold off until each of those is placed (its pages reserved, or
its first token) or gone, which wakes them. Equal priorities try together, as they always did: first
come, first served gives every request priority 0, so nothing changes there (and nobody is woken for
nothing when a waiter is placed: its pages are taken, not freed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from control.fleet import Fleet


class WaitingRoom:
    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self._waiting: dict[str, int] = {}  # request uid -> its priority (lower goes first)

    async def wait(self, uid: str, priority: int, version: int, deadline: float) -> bool:
        """Sleep until the fleet's version moves past `version`, then until no request of a better
        (lower) priority is waiting; the request counts as waiting until `leave(uid)`. False when
        `deadline` (monotonic) passes first."""
        self._waiting[uid] = priority
        if not await self.fleet.wait_change(version, deadline):
            return False
        while self._ahead(priority):
            if not await self.fleet.wait_change(self.fleet.version, deadline):
                return False
        return True

    @contextmanager
    def visit(self, uid: str) -> Iterator[None]:
        """One request's whole stay: however it ends, it leaves the room."""
        try:
            yield
        finally:
            self.leave(uid)

    def leave(self, uid: str) -> None:
        """The request is placed or gone: those it held off (all of a worse priority, once it was the
        last of the best) try again. Idempotent."""
        priority = self._waiting.pop(uid, None)
        if priority is not None and self._waiting and not self._ahead(priority + 1):
            self.fleet.poke()

    def _ahead(self, priority: int) -> bool:
        """Whether a request of a better priority than `priority` is waiting."""
        return any(p < priority for p in self._waiting.values())
