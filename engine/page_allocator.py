"""The caching page allocator of a paged KV pool: fixed-size pages with reference counts.

A request owns a page table: the list of page ids holding its tokens in order (the storage itself is
engine/kv_pool.py's KVCache). Prefix caching: a full page whose KV is computed can be committed under
its chained hash (tandem/prefix.py). When its last request ends the page is kept, cached, until the
pool needs it; a later request with the same prefix takes a reference to it (`match`) instead of
computing it again.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from enum import Enum

from engine.cache_events import CacheEventLog
from engine.errors import OutOfPages
from tandem.prefix import HASH_BYTES


class PageState(Enum):
    """Where a page is. Every page is in exactly one state."""

    FREE = "free"      # refcount 0, no hash: on the free list
    USED = "used"      # refcount > 0: owned by requests; may hold a hash that others can match
    CACHED = "cached"  # refcount 0 with a hash: kept for reuse, evicted least recently used first


@dataclass(frozen=True)
class PrefixCacheCounters:
    """Running totals since the allocator was made. Hits and misses count pages asked of `match`."""

    hit_pages: int
    miss_pages: int
    evicted_pages: int  # cached pages reclaimed by `allocate` (not those dropped by `flush`)
    cached_pages: int   # now


class PageAllocator:
    """Hands out page ids with reference counts; with `prefix_cache`, keeps committed pages for reuse.

    `allocate` is all-or-nothing: on OutOfPages nothing changed. It takes free pages first, then evicts
    cached pages, least recently used first (their hashes are dropped). A referenced page is never
    evicted and never changes hash. With `prefix_cache=False` no page is ever cached: `commit` does
    nothing, `match` finds nothing, and the allocator behaves as a plain free list.

    Not thread-safe: the owner serializes calls. Every operation costs O(pages it touches).
    """

    def __init__(self, num_pages: int, prefix_cache: bool = True, max_events: int | None = None):
        """`max_events`: distinct hash changes kept between drains (default max(1024, 2 * num_pages))."""
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least 1 page, got {num_pages}")
        self.num_pages = num_pages
        self.enabled = prefix_cache
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self._hash_of: list[bytes | None] = [None] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._events = CacheEventLog(max_events if max_events is not None else max(1024, 2 * num_pages))
        self._hits = self._misses = self._evictions = 0

    @property
    def num_used(self) -> int:
        """Pages with references. Cached pages are reclaimable and not counted."""
        return self.num_pages - len(self._free) - len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free) + len(self._lru)

    def allocate(self, n: int) -> list[int]:
        """n pages, each with one reference; raises OutOfPages(n, free + cached) leaving the pool as it was."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if not self.can_allocate(n):
            raise OutOfPages(n, len(self._free) + len(self._lru))
        pages = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        while len(pages) < n:
            page, _ = self._lru.popitem(last=False)
            self._drop_hash(page)
            self._evictions += 1
            pages.append(page)
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a reference to pages another owner already holds (e.g. a shared prompt prefix)."""
        self._check_owned(pages)
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page. At zero, a page with a hash becomes cached, others free.

        Give `pages` in page-table order: they enter the LRU last page first, so a request's tail is
        evicted before its head (a prefix can only be matched from its first page on).
        """
        self._check_owned(pages)
        for page, n in Counter(pages).items():
            if n > self._refs[page]:
                raise ValueError(f"page {page} is freed {n} times but holds {self._refs[page]} references")
        newly_cached = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if self._hash_of[p] is not None:
                    newly_cached.append(p)
                else:
                    self._free.append(p)
        for p in reversed(newly_cached):
            self._lru[p] = None

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def page_state(self, page: int) -> PageState:
        if self._refs[page] > 0:
            return PageState.USED
        return PageState.FREE if self._hash_of[page] is None else PageState.CACHED

    def page_hash(self, page: int) -> bytes | None:
        """The hash the page is committed under, or None."""
        return self._hash_of[page]

    def commit(self, page: int, h: bytes) -> bool:
        """Record that `page` (in use, full, its KV computed) holds the content named `h`.

        Returns whether the page now holds `h`. If another page already holds `h`, that mapping is kept
        and this page stays un-hashed (returns False): the first copy may be referenced by other
        requests, so re-pointing gains nothing, and this page simply returns to the free list when its
        owner frees it. Committing a page's own hash again is a no-op; a different one is refused.
        With prefix caching off this does nothing and returns False.
        """
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ValueError(f"a page hash is {HASH_BYTES} bytes (tandem.prefix.page_hashes), got {h!r:.40}")
        self._check_owned([page])
        if not self.enabled:
            return False
        held = self._hash_of[page]
        if held is not None:
            if held != h:
                raise ValueError(f"page {page} is in use and already holds another hash; "
                                 f"its content cannot change while it is referenced")
            return True
        if h in self._page_of:
            return False
        self._hash_of[page] = h
        self._page_of[h] = page
        self._events.record(h, True)
        return True

    def match(self, hashes: list[bytes]) -> list[int]:
        """The pages holding the longest leading run of `hashes`, each with a new reference.

        A cached page leaves the LRU while referenced. Free them with `free` like allocated pages.
        """
        if not self.enabled:
            return []
        pages = self._leading_run(hashes)
        for p in pages:
            if self._refs[p] == 0:
                del self._lru[p]
            self._refs[p] += 1
        self._hits += len(pages)
        self._misses += len(hashes) - len(pages)
        return pages

    def allocate_prefixed(self, hashes: list[bytes], n: int) -> tuple[list[int], int]:
        """n pages whose leading ones hold the longest cached run of `hashes` (each with a new reference);
        returns (pages, how many were matched). All-or-nothing: on OutOfPages nothing changed, not even
        the hit counters. The matched pages are never the ones evicted to make room for the rest."""
        run = self._leading_run(hashes[:n]) if self.enabled else []
        idle = sum(1 for p in run if self._refs[p] == 0)  # matching takes these out of the reclaimable set
        if n - len(run) > len(self._free) + len(self._lru) - idle:
            raise OutOfPages(n - len(run), len(self._free) + len(self._lru) - idle)
        matched = self.match(hashes[:n])  # the same run: nothing changed since it was looked up
        return matched + self.allocate(n - len(matched)), len(matched)

    def held_hashes(self) -> list[bytes]:
        """Every hash the pool holds (in use or cached), oldest commit first; changes nothing."""
        return list(self._page_of)

    def peek(self, hashes: list[bytes]) -> int:
        """How many pages `match(hashes)` would return now; changes nothing."""
        return len(self._leading_run(hashes)) if self.enabled else 0

    def flush(self) -> int:
        """Forget every cached page (they become free); in-use pages keep their hash. Returns how many."""
        dropped = len(self._lru)
        while self._lru:
            page, _ = self._lru.popitem(last=False)
            self._drop_hash(page)
            self._free.append(page)
        return dropped

    def counters(self) -> PrefixCacheCounters:
        return PrefixCacheCounters(self._hits, self._misses, self._evictions, len(self._lru))

    @property
    def resync_needed(self) -> bool:
        """True when the event log overflowed: send `snapshot()` instead of `drain_events()`."""
        return self._events.overflowed

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes newly held, hashes no longer held) since the last drain or snapshot; disjoint lists.

        Raises RuntimeError when `resync_needed`: the changes were too many to keep.
        """
        return self._events.drain()

    def snapshot(self) -> list[bytes]:
        """Every hash the pool holds (in use or cached); restarts the event log from this state."""
        self._events.reset()
        return list(self._page_of)

    def _leading_run(self, hashes: list[bytes]) -> list[int]:
        pages = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def _drop_hash(self, page: int) -> None:
        h = self._hash_of[page]
        self._hash_of[page] = None
        del self._page_of[h]
        self._events.record(h, False)

    def _check_owned(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages or self._refs[p] == 0:
                raise ValueError(f"page {p} is not allocated in this pool (pool has {self.num_pages} pages)")
