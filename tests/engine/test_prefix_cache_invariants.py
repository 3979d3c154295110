"""Random operation sequences against the caching page allocator, checked against a plain model.

The model keeps the same facts the simple way (lists, linear scans): reference counts, each page's
hash, the LRU order of cached pages, and what a router following the event log believes. After every
step the allocator must agree with it, and a page must be in exactly one state.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.errors import OutOfPages
from engine.page_allocator import PageAllocator, PageState

POOL = 6
HASHES = [bytes([i]) * 16 for i in range(8)]  # few distinct hashes, so matches and duplicates are common


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = PageAllocator(POOL, max_events=4)  # small, so resyncs happen too
        self.refs = [0] * POOL
        self.hash_of: dict[int, bytes] = {}
        self.lru: list[int] = []  # cached pages, least recently used first
        self.held: list[list[int]] = []  # each entry holds one reference to each of its pages
        self.view: set[bytes] = set()  # the router's belief, from events and snapshots
        self.hits = self.misses = self.evictions = 0

    def observe(self):
        return [(self.a.refcount(p), self.a.page_hash(p), self.a.page_state(p)) for p in range(POOL)]

    @rule(n=st.integers(0, POOL + 1))
    def allocate(self, n):
        free = {p for p in range(POOL) if self.refs[p] == 0 and p not in self.hash_of}
        if n > len(free) + len(self.lru):
            before = self.observe()
            with pytest.raises(OutOfPages):
                self.a.allocate(n)
            assert self.observe() == before  # all or nothing
            return
        pages = self.a.allocate(n)
        evicted = self.lru[:max(0, n - len(free))]
        assert len(set(pages)) == n
        assert set(pages) - set(evicted) <= free and set(pages) & set(self.lru) == set(evicted)
        del self.lru[:len(evicted)]
        for p in evicted:
            del self.hash_of[p]
        self.evictions += len(evicted)
        for p in pages:
            self.refs[p] = 1
        self.held.append(pages)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        pages = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.a.free(pages)
        newly_cached = []
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0 and p in self.hash_of:
                newly_cached.append(p)
        self.lru.extend(reversed(newly_cached))  # a request's tail becomes the older end

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share(self, data):
        pages = data.draw(st.sampled_from(self.held))
        self.a.share(pages)
        for p in pages:
            self.refs[p] += 1
        self.held.append(list(pages))

    @precondition(lambda self: any(self.held))
    @rule(data=st.data(), h=st.sampled_from(HASHES))
    def commit(self, data, h):
        page = data.draw(st.sampled_from([p for pages in self.held for p in pages]))
        mine = self.hash_of.get(page)
        if mine is not None and mine != h:
            with pytest.raises(ValueError, match="already holds another hash"):
                self.a.commit(page, h)
            return
        expect = mine == h or h not in self.hash_of.values()
        assert self.a.commit(page, h) == expect
        if expect:
            self.hash_of[page] = h

    @rule(hashes=st.lists(st.sampled_from(HASHES), max_size=4))
    def match(self, hashes):
        page_of = {h: p for p, h in self.hash_of.items()}
        want = []
        for h in hashes:
            if h not in page_of:
                break
            want.append(page_of[h])
        assert self.a.peek(hashes) == len(want)
        got = self.a.match(hashes)
        assert got == want and [self.a.page_hash(p) for p in got] == hashes[:len(got)]
        for p in got:
            if self.refs[p] == 0:
                self.lru.remove(p)
            self.refs[p] += 1
        self.hits += len(got)
        self.misses += len(hashes) - len(got)
        if got:
            self.held.append(got)

    @rule()
    def flush(self):
        assert self.a.flush() == len(self.lru)
        for p in self.lru:
            del self.hash_of[p]
        self.lru = []

    @rule()
    def sync_router(self):
        if self.a.resync_needed:
            self.view = set(self.a.snapshot())
        else:
            stored, removed = self.a.drain_events()
            assert not set(stored) & set(removed)
            self.view = (self.view | set(stored)) - set(removed)
        assert self.view == set(self.hash_of.values())

    @invariant()
    def agrees_with_the_model(self):
        for p in range(POOL):
            assert self.a.refcount(p) == self.refs[p]
            assert self.a.page_hash(p) == self.hash_of.get(p)
            want = (PageState.USED if self.refs[p] else
                    PageState.CACHED if p in self.hash_of else PageState.FREE)
            assert self.a.page_state(p) is want
        used = sum(r > 0 for r in self.refs)
        assert (self.a.num_used, self.a.num_cached) == (used, len(self.lru))
        assert sorted(self.lru) == sorted(p for p in self.hash_of if self.refs[p] == 0)
        assert len(set(self.hash_of.values())) == len(self.hash_of)  # one page per hash
        c = self.a.counters()
        assert (c.hit_pages, c.miss_pages, c.evicted_pages) == (self.hits, self.misses, self.evictions)
        assert self.a.can_allocate(POOL - used) and not self.a.can_allocate(POOL - used + 1)


AllocatorMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestAllocatorInvariants = AllocatorMachine.TestCase
