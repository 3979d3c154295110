"""How requests use the pool's prefix cache (engine/prefix_cache.py) and how its changes reach several
watchers (engine/workers/cache_feed.py): the rules, on a real allocator, without a model."""

from __future__ import annotations

import pytest

from engine.errors import OutOfPages
from engine.page_allocator import PageAllocator
from engine.prefix_cache import PrefixCache
from engine.sequence import Sequence
from engine.workers.cache_feed import CacheFeed
from tandem.prefix import engine_salt, page_hashes
from tandem.sampling_params import SamplingParams

TPP = 4
SALT = engine_salt("sha256:test", {"tokens_per_page": TPP})


def seq(tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(max_tokens=max_tokens), frozenset(), 1000)


def run(cache: PrefixCache, tokens: list[int]) -> tuple[int, list[int]]:
    """A request computed to the end of its prompt and released: (tokens it took from the cache, its table)."""
    s = seq(tokens)
    cached = cache.reserve(s, -(-(len(tokens) + 4) // TPP))
    s.num_cached = len(tokens)  # the pass computed the rest
    cache.commit(s)
    table = list(s.page_table)
    cache.allocator.free(s.page_table)
    return cached, table


def test_a_prompt_reuses_whole_pages_but_never_its_last_token():
    cache = PrefixCache(PageAllocator(32), TPP, SALT)
    prompt = list(range(100, 112))  # exactly 3 pages
    assert run(cache, prompt)[0] == 0
    cached, _ = run(cache, prompt)
    assert cached == 8  # not 12: the last token is computed again for its logits
    cached, _ = run(cache, prompt + [7, 8, 9])
    assert cached == 12
    cached, _ = run(cache, prompt[:6] + [1] * 6)  # diverges inside page 1: only page 0 is shared
    assert cached == 4


def test_only_computed_full_pages_are_named_and_each_once():
    a = PageAllocator(16)
    cache = PrefixCache(a, TPP, SALT)
    s = seq(list(range(10)))
    cache.reserve(s, 4)
    s.num_cached = 6  # a chunk of 6 tokens computed: one full page
    assert cache.commit(s) == 1 and cache.commit(s) == 0
    assert a.held_hashes() == page_hashes(list(range(10)), TPP, SALT)[:1]
    s.output_ids += [50, 51]  # decoding on: positions past the prompt are outputs
    s.num_cached = 12
    assert cache.commit(s) == 2
    assert a.held_hashes() == page_hashes(list(range(10)) + [50, 51], TPP, SALT)
    a.free(s.page_table)


def test_a_reservation_that_does_not_fit_changes_nothing():
    a = PageAllocator(6)
    cache = PrefixCache(a, TPP, SALT)
    run(cache, list(range(13)))  # 3 named pages, all idle
    before = a.counters()
    with pytest.raises(OutOfPages):
        cache.reserve(seq(list(range(13))), 7)  # 3 cached + 4 more: the pool has 6
    assert a.counters() == before and a.num_cached == 3 and a.num_used == 0
    s = seq(list(range(13)))
    assert cache.reserve(s, 6) == 12 and a.num_used == 6  # 3 shared + 3 new: exactly the pool
    assert cache.peek(seq(list(range(13)))) == 12
    a.free(s.page_table)


def test_with_the_cache_off_nothing_is_reused():
    cache = PrefixCache(PageAllocator(16, prefix_cache=False), TPP, SALT)
    run(cache, list(range(12)))
    assert run(cache, list(range(16)))[0] == 0 and cache.peek(seq(list(range(16)))) == 0


def test_each_subscriber_gets_every_change_or_a_snapshot():
    a = PageAllocator(16, max_events=4)
    cache = PrefixCache(a, TPP, SALT)
    feed = CacheFeed(capacity=6)
    feed.subscribe("early")
    assert feed.take("early") == ([], [], True)  # the first report is the (empty) whole set
    run(cache, list(range(9)))  # 2 pages named
    feed.collect(a)
    feed.subscribe("late")
    stored, removed, resync = feed.take("early")
    assert sorted(stored) == sorted(a.held_hashes()) and removed == [] and not resync
    assert feed.take("late") == (a.held_hashes(), [], True)
    first = set(a.held_hashes())
    run(cache, list(range(200, 221)))  # 5 more: more than the allocator's event log keeps (4)
    feed.collect(a)  # the allocator's overflow is healed by diffing its snapshot with the feed's mirror
    for who in ("early", "late"):
        stored, removed, resync = feed.take(who)
        assert set(stored) == set(a.held_hashes()) - first and removed == [] and not resync
    a.flush()  # 7 removed: more than the feed keeps per subscriber (6)
    feed.collect(a)
    assert feed.take("early") == ([], [], True) and a.held_hashes() == []
    feed.unsubscribe("late")
    assert feed.take("late") == ([], [], False)
