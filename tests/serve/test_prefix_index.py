"""The router's prefix index: event batches, snapshots, the memory cap, and agreement with a real pool."""

from __future__ import annotations

import random

import pytest

from engine.page_allocator import PageAllocator
from control.prefix_index import PrefixIndex
from tandem.prefix import engine_salt, page_hashes

SALT = engine_salt("sha256:test", {"tokens_per_page": 4})
H = page_hashes(list(range(40)), 4, SALT)


def test_matched_pages_is_the_leading_run_a_worker_holds():
    ix = PrefixIndex()
    ix.apply("d0", stored=[H[0], H[1], H[3]], removed=[])
    assert ix.matched_pages("d0", H[:5]) == 2
    assert ix.matched_pages("d0", H[1:2]) == 1 and ix.matched_pages("d0", []) == 0
    assert ix.matched_pages("d1", H[:5]) == 0  # never reported: holds nothing we know of
    ix.apply("d0", stored=[H[2]], removed=[H[0]])
    assert ix.matched_pages("d0", H[:5]) == 0 and ix.matched_pages("d0", H[1:5]) == 3
    assert ix.num_hashes("d0") == 3 and ix.workers() == ["d0"]


def test_a_snapshot_replaces_and_drop_forgets():
    ix = PrefixIndex()
    ix.apply("d0", [H[0], H[1]], [])
    ix.apply("d1", [H[0]], [])
    ix.replace("d0", [H[5]])
    assert ix.matched_pages("d0", H[:2]) == 0 and ix.matched_pages("d0", H[5:6]) == 1
    ix.drop("d0")
    ix.drop("never-seen")
    assert ix.workers() == ["d1"] and ix.matched_pages("d0", H[5:6]) == 0


def test_the_cap_forgets_the_oldest_reports_first():
    ix = PrefixIndex(max_hashes_per_worker=3)
    ix.apply("d0", H[0:3], [])
    ix.apply("d0", [H[0]], [])  # reported again: now the newest
    ix.apply("d0", [H[3]], [])
    assert ix.num_hashes("d0") == 3
    assert [ix.matched_pages("d0", [h]) for h in H[:4]] == [1, 0, 1, 1]
    ix.replace("d0", H[:5])  # a snapshot over the cap keeps its newest end
    assert [ix.matched_pages("d0", [h]) for h in H[:5]] == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("call, match", [
    (lambda ix: ix.apply("", [], []), "worker name"),
    (lambda ix: ix.apply(None, [], []), "worker name"),
    (lambda ix: ix.apply("d0", [b"short"], []), r"stored\[0\] is not a 16-byte page hash"),
    (lambda ix: ix.apply("d0", [], [H[0], H[1].hex()]), r"removed\[1\]"),
    (lambda ix: ix.replace("d0", [H[0], 7]), r"snapshot\[1\]"),
    (lambda ix: ix.apply("d0", [H[0], H[1]], [H[1]]), "both stored and removed"),
])
def test_bad_reports_are_refused_and_change_nothing(call, match):
    ix = PrefixIndex()
    ix.apply("d0", [H[7]], [])
    with pytest.raises(ValueError, match=match):
        call(ix)
    assert ix.num_hashes("d0") == 1 and ix.matched_pages("d0", H[7:8]) == 1


def test_the_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_hashes_per_worker"):
        PrefixIndex(max_hashes_per_worker=0)


def _report(ix: PrefixIndex, name: str, pool: PageAllocator) -> None:
    """What a worker's stats reply carries, applied the way the router applies it."""
    if pool.resync_needed:
        ix.replace(name, pool.snapshot())
    else:
        ix.apply(name, *pool.drain_events())


def test_the_index_follows_real_pools_through_random_traffic():
    rng = random.Random(12)
    prompts = [[rng.randrange(1000) for _ in range(24)] for _ in range(6)]
    prompts += [p[:12] + [rng.randrange(1000) for _ in range(8)] for p in prompts[:3]]  # shared prefixes
    hashes = [page_hashes(p, 4, SALT) for p in prompts]
    pools = {"d0": PageAllocator(10, max_events=6), "d1": PageAllocator(14, max_events=1000)}
    ix = PrefixIndex()
    resyncs = 0
    for step in range(400):
        name = rng.choice(sorted(pools))
        pool, want = pools[name], rng.choice(hashes)
        reused = pool.match(want)
        if pool.can_allocate(len(want) - len(reused)):
            table = reused + pool.allocate(len(want) - len(reused))
            for p, h in zip(table[len(reused):], want[len(reused):]):
                pool.commit(p, h)
            pool.free(table)
        else:
            pool.free(reused)
        if rng.random() < 0.02:
            pool.flush()
        if step % 3 == 0:
            resyncs += pool.resync_needed
            _report(ix, name, pool)
            for q in hashes:
                assert ix.matched_pages(name, q) == pool.peek(q)
    assert resyncs > 0  # the small event log overflowed at least once and a snapshot healed it
    assert sum(ix.matched_pages("d1", q) for q in hashes) > 0
