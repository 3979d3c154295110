#!/usr/bin/env python3
"""Prefix-cache building blocks, timed: page hashing of 1k/8k-token prompts and allocator operations.

Prints microseconds per prompt for `page_hashes` (and per page appended by `extend_page_hashes`, the
decode path), the wire form, and operations per second for the caching PageAllocator's request cycle
(match + allocate + commit + free) and for the router's PrefixIndex lookups.

    python scripts/bench_prefix_hash.py [--tokens-per-page 16] [--repeat 200]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engine.page_allocator import PageAllocator  # noqa: E402
from control.prefix_index import PrefixIndex  # noqa: E402
from tandem.prefix import engine_salt, extend_page_hashes, hashes_from_hex, hashes_to_hex, page_hashes  # noqa: E402


def best_us(fn, repeat: int) -> float:
    """Best of `repeat` timed calls, in microseconds (the least disturbed by other processes)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def bench_hashing(tpp: int, repeat: int, salt: bytes) -> None:
    rng = random.Random(0)
    for n in (1024, 8192):
        tokens = [rng.randrange(128256) for _ in range(n)]
        us = best_us(lambda: page_hashes(tokens, tpp, salt), repeat)
        text = hashes_to_hex(page_hashes(tokens, tpp, salt))
        wire = best_us(lambda: hashes_from_hex(text), repeat)
        print(f"page_hashes  {n:5d} tokens ({n // tpp:4d} pages): {us:8.1f} us  "
              f"({us * 1000 / n:5.1f} ns/token); parse wire form ({len(text)} chars): {wire:6.1f} us")
    tokens = [rng.randrange(128256) for _ in range(8192)]
    hashes = page_hashes(tokens[:8192 - tpp], tpp, salt)

    def grow():
        h = list(hashes)
        extend_page_hashes(h, tokens, tpp, salt)
    print(f"extend_page_hashes, one new page after {len(hashes)}: {best_us(grow, repeat):6.1f} us "
          f"(includes copying the list)")


def bench_allocator(tpp: int, salt: bytes, requests: int = 20000) -> None:
    rng = random.Random(1)
    prefixes = [[rng.randrange(32000) for _ in range(512)] for _ in range(8)]
    # 512 prompts of 8 shared system prompts + a private suffix: more distinct pages than the pool holds,
    # so the cycle exercises hits on the prefixes, misses on the suffixes, and LRU eviction
    prompts = [rng.choice(prefixes) + [rng.randrange(32000) for _ in range(256)] for _ in range(512)]
    hashes = [page_hashes(p, tpp, salt) for p in prompts]
    a = PageAllocator(max(len(hashes[0]), 2048 * 16 // tpp))
    t = time.perf_counter()
    pages_touched = 0
    for i in range(requests):
        want = hashes[i % len(hashes)]
        reused = a.match(want)
        table = reused + a.allocate(len(want) - len(reused))
        for p, h in zip(table[len(reused):], want[len(reused):]):
            a.commit(p, h)
        a.free(table)
        pages_touched += len(want)
    dt = time.perf_counter() - t
    c = a.counters()
    print(f"PageAllocator request cycle ({len(hashes[0])} pages each): {requests / dt:9.0f} requests/s, "
          f"{pages_touched / dt / 1e6:5.2f} M pages/s; hit rate {c.hit_pages / (c.hit_pages + c.miss_pages):.2f}, "
          f"evictions {c.evicted_pages}")
    plain = PageAllocator(a.num_pages, prefix_cache=False)
    t = time.perf_counter()
    for _ in range(requests):
        plain.free(plain.allocate(len(hashes[0])))
    dt = time.perf_counter() - t
    print(f"PageAllocator allocate+free, caching off ({len(hashes[0])} pages): {requests / dt:9.0f} requests/s")
    ix = PrefixIndex()
    ix.replace("d0", a.snapshot())
    t = time.perf_counter()
    for i in range(requests):
        ix.matched_pages("d0", hashes[i % len(hashes)])
    dt = time.perf_counter() - t
    print(f"PrefixIndex.matched_pages ({len(hashes[0])} hashes): {requests / dt:9.0f} lookups/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-page", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    if args.tokens_per_page < 1 or args.repeat < 1:
        ap.error("--tokens-per-page and --repeat must be >= 1")
    salt = engine_salt("sha256:bench", {"tokens_per_page": args.tokens_per_page})
    bench_hashing(args.tokens_per_page, args.repeat, salt)
    bench_allocator(args.tokens_per_page, salt)


if __name__ == "__main__":
    main()
