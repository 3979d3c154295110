"""The prefix-cache event log: which page hashes a KV pool started or stopped holding since last asked.

A worker drains it into its stats replies so the router's PrefixIndex (control/prefix_index.py)
can follow what each worker caches without ever asking for the whole set, except after an overflow.
"""

from __future__ import annotations


class CacheEventLog:
    """The net change to the set of hashes a pool holds since the last drain, bounded.

    Only the latest state of each hash is kept (stored, then removed, is reported as removed), so a
    drained batch's stored and removed lists are disjoint and can be applied in either order. When more
    than `capacity` distinct hashes change between drains the log gives up and sets `overflowed`: the
    reader must then take a full snapshot instead.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"the cache event log needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.overflowed = False
        self._net: dict[bytes, bool] = {}  # hash -> held now

    def record(self, h: bytes, held: bool) -> None:
        if self.overflowed:
            return
        if h not in self._net and len(self._net) >= self.capacity:
            self.overflowed = True
            self._net.clear()
            return
        self._net[h] = held

    def drain(self) -> tuple[list[bytes], list[bytes]]:
        if self.overflowed:
            raise RuntimeError("the prefix-cache event log overflowed since the last drain; "
                               "call snapshot() for the full set of hashes instead")
        stored = [h for h, held in self._net.items() if held]
        removed = [h for h, held in self._net.items() if not held]
        self._net.clear()
        return stored, removed

    def reset(self) -> None:
        self._net.clear()
        self.overflowed = False
