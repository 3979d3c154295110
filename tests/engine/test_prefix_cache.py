"""The caching page allocator: page states, LRU eviction, matching, commit rules, events, counters."""

from __future__ import annotations

import pytest

from engine.errors import OutOfPages
from engine.page_allocator import PageAllocator, PageState
from tandem.prefix import engine_salt, page_hashes

SALT = engine_salt("sha256:test", {"tokens_per_page": 4})
H = page_hashes(list(range(40)), 4, SALT)  # 10 chained hashes: H[i] names page i of one prompt


def cached_request(a: PageAllocator, hashes: list[bytes]) -> list[int]:
    """Run a request whose pages hold `hashes` to its end: allocate, commit each page, free. Its pages."""
    pages = a.allocate(len(hashes))
    for p, h in zip(pages, hashes):
        assert a.commit(p, h)
    a.free(pages)
    return pages


def states(a: PageAllocator) -> dict[PageState, int]:
    out = dict.fromkeys(PageState, 0)
    for p in range(a.num_pages):
        out[a.page_state(p)] += 1
    return out


def test_a_finished_request_leaves_its_committed_pages_cached_and_matchable():
    a = PageAllocator(8)
    pages = cached_request(a, H[:3])
    assert a.num_used == 0 and a.num_cached == 3 and states(a)[PageState.CACHED] == 3
    assert a.peek(H[:5]) == 3 and a.num_cached == 3  # peek changes nothing
    got = a.match(H[:5])
    assert got == pages and [a.refcount(p) for p in got] == [1, 1, 1]
    assert a.num_used == 3 and a.num_cached == 0  # referenced pages leave the LRU
    c = a.counters()
    assert (c.hit_pages, c.miss_pages, c.cached_pages) == (3, 2, 0)
    a.free(got)
    assert a.num_cached == 3


def test_match_stops_at_the_first_missing_page():
    a = PageAllocator(8)
    pages = cached_request(a, [H[0], H[1], H[3]])
    assert a.match([H[0], H[1], H[2], H[3]]) == pages[:2]
    assert a.match([H[1]]) == [pages[1]] and a.refcount(pages[1]) == 2
    assert a.match([H[5], H[0]]) == []


def test_pages_in_use_can_be_matched_by_another_request():
    a = PageAllocator(4)
    owner = a.allocate(2)
    a.commit(owner[0], H[0])
    assert a.match(H[:2]) == [owner[0]] and a.refcount(owner[0]) == 2
    a.free(owner)
    assert a.page_state(owner[0]) is PageState.USED and a.page_state(owner[1]) is PageState.FREE


def test_allocate_takes_free_pages_before_cached_ones():
    a = PageAllocator(6)
    cached = cached_request(a, H[:3])
    fresh = a.allocate(3)
    assert not set(fresh) & set(cached) and a.num_cached == 3 and a.counters().evicted_pages == 0


def test_eviction_is_least_recently_used_and_a_request_tail_goes_first():
    a = PageAllocator(6)
    first = cached_request(a, H[0:3])
    second = cached_request(a, H[3:6])
    a.free(a.match([H[0]]))  # page H[0] was used again: now the most recent
    got = a.allocate(2)
    assert set(got) == {first[2], first[1]}  # the oldest request's tail, not its head
    assert a.peek(H[0:3]) == 1 and a.peek(H[3:6]) == 3
    assert a.page_hash(got[0]) is None and a.page_hash(got[1]) is None
    assert a.counters().evicted_pages == 2
    got += a.allocate(3)
    assert set(got) == set(first[1:]) | set(second)  # H[0]'s page, the most recent, survives
    assert a.peek(H[0:1]) == 1


def test_out_of_pages_counts_cached_pages_and_changes_nothing():
    a = PageAllocator(4)
    cached_request(a, H[:2])
    held = a.allocate(1)
    assert a.can_allocate(3) and not a.can_allocate(4)
    before = [(a.page_state(p), a.page_hash(p), a.refcount(p)) for p in range(4)]
    with pytest.raises(OutOfPages) as e:
        a.allocate(4)
    assert e.value.needed == 4 and e.value.free == 3
    assert [(a.page_state(p), a.page_hash(p), a.refcount(p)) for p in range(4)] == before
    assert a.peek(H[:2]) == 2 and a.counters().evicted_pages == 0
    a.free(held)


def test_a_hash_already_held_elsewhere_is_not_duplicated():
    a = PageAllocator(4)
    first, second = a.allocate(2)
    assert a.commit(first, H[0]) and not a.commit(second, H[0])
    assert a.page_hash(second) is None and a.commit(first, H[0])  # committing again is a no-op
    a.free([first, second])
    assert a.page_state(first) is PageState.CACHED and a.page_state(second) is PageState.FREE
    assert a.snapshot() == [H[0]]


def test_commit_refuses_pages_not_in_use_and_rehashing():
    a = PageAllocator(4)
    cached = cached_request(a, H[:1])[0]
    with pytest.raises(ValueError, match="not allocated"):
        a.commit(cached, H[0])  # cached, refcount 0: nobody may write it
    with pytest.raises(ValueError, match="not allocated"):
        a.commit(99, H[1])
    (page,) = a.match(H[:1])
    with pytest.raises(ValueError, match="already holds another hash"):
        a.commit(page, H[1])
    with pytest.raises(ValueError, match="16 bytes"):
        a.commit(page, b"short")
    assert a.page_hash(page) == H[0]


def test_freeing_more_references_than_held_changes_nothing():
    a = PageAllocator(4)
    pages = a.allocate(2)
    with pytest.raises(ValueError, match="freed 2 times but holds 1"):
        a.free([pages[0], pages[1], pages[0]])
    assert [a.refcount(p) for p in pages] == [1, 1]
    a.free(pages)
    assert a.num_used == 0


def test_flush_forgets_only_idle_pages():
    a = PageAllocator(6)
    cached_request(a, H[:3])
    busy = a.allocate(1)
    a.commit(busy[0], H[5])
    a.drain_events()
    assert a.flush() == 3
    assert a.num_cached == 0 and states(a)[PageState.FREE] == 5
    assert a.peek(H[:3]) == 0 and a.peek([H[5]]) == 1
    stored, removed = a.drain_events()
    assert stored == [] and sorted(removed) == sorted(H[:3])
    assert a.counters().evicted_pages == 0


def test_events_report_the_net_change_since_the_last_drain():
    a = PageAllocator(3, max_events=100)
    first = cached_request(a, H[:3])
    assert a.drain_events() == (H[:3], []) and a.drain_events() == ([], [])
    a.allocate(2)  # evicts H[2] then H[1]
    stored, removed = a.drain_events()
    assert stored == [] and sorted(removed) == sorted(H[1:3])
    page = a.allocate(1)  # evicts H[0] ...
    a.commit(page[0], H[0])  # ... which is stored again within one drain window
    assert a.drain_events() == ([H[0]], []) and page == [first[0]]


def test_an_overflowing_event_log_asks_for_a_snapshot():
    a = PageAllocator(8, max_events=2)
    cached_request(a, H[:3])
    assert a.resync_needed
    with pytest.raises(RuntimeError, match="snapshot"):
        a.drain_events()
    assert sorted(a.snapshot()) == sorted(H[:3]) and not a.resync_needed
    assert a.drain_events() == ([], [])
    a.free(a.match(H[:1]))
    assert a.drain_events() == ([], [])  # matching and freeing change no hash


def test_with_prefix_caching_off_it_is_a_plain_free_list():
    a = PageAllocator(4, prefix_cache=False)
    pages = a.allocate(2)
    assert not a.commit(pages[0], H[0]) and a.page_hash(pages[0]) is None
    a.free(pages)
    assert a.num_cached == 0 and a.num_used == 0 and states(a)[PageState.FREE] == 4
    assert a.match(H[:1]) == [] and a.peek(H[:1]) == 0
    assert a.snapshot() == [] and a.drain_events() == ([], [])
    assert list(a._free) == [2, 3, 0, 1]  # freed pages go to the back, in order, as before caching


def test_a_prompt_reuses_the_pages_of_an_earlier_prompt_with_the_same_prefix():
    tpp = 4
    a = PageAllocator(16)
    system = list(range(100, 112))  # 3 pages shared by both prompts
    first = system + [1, 2, 3, 4, 5, 6]
    second = system + [7, 8, 9, 10, 11]

    def run(prompt: list[int]) -> tuple[int, list[int]]:
        hashes = page_hashes(prompt, tpp, SALT)
        reused = a.match(hashes)
        table = reused + a.allocate(-(-len(prompt) // tpp) - len(reused))
        for p, h in zip(table[len(reused):len(hashes)], hashes[len(reused):]):
            a.commit(p, h)  # full pages whose KV was just computed
        a.free(table)
        return len(reused), table

    n1, t1 = run(first)
    n2, t2 = run(second)
    assert n1 == 0 and n2 == 3 and t2[:3] == t1[:3] and t2[3] != t1[3]
    assert a.num_used == 0 and a.num_cached == 5  # 3 shared + 1 of `first` + 1 of `second`


def test_bad_pool_arguments_are_refused():
    with pytest.raises(ValueError, match="at least 1 page"):
        PageAllocator(0)
    with pytest.raises(ValueError, match="capacity >= 1"):
        PageAllocator(4, max_events=0)
    with pytest.raises(ValueError, match="cannot allocate -1"):
        PageAllocator(4).allocate(-1)
