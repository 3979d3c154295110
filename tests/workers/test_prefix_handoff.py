"""The prefix cache in the workers (one process, inproc transport, real model): a shared prefix is
reused on both sides of the handoff, only what the decode worker lacks is moved, outputs stay exact
(against the same model without a cache), shared pages are never written, and every watcher hears of
every change. Eviction under pools too small for the working set changes no output and leaks no page."""

from __future__ import annotations

import itertools
import threading

import pytest

from engine.engine import Engine
from engine.errors import OutOfPages
from engine.kv_pool import KVCache
from engine.page_allocator import PageState
from engine.tokenizer import ChatMessage
from engine.transports.host import PoolHost
from engine.workers.decode_worker import DecodeWorker
from engine.workers.prefill_worker import PrefillWorker
from control.prefix_index import PrefixView
from tandem.prefix import page_hashes
from tandem.sampling_params import SamplingParams
from tandem.wire import Open, Prefilled, Start, WorkerStats
from tests.conftest import complete
from tests.workers.test_handoff import ListSink, prefill_into, reserve, wait_until

SYSTEM = ("You are a careful assistant for a harbor town. Answer briefly, name the ships you mention, and "
          "never invent tide tables. The harbor has three piers, a lighthouse and a copper market.")
QUESTIONS = ["Which pier is closest to the lighthouse?", "What is sold at the copper market?",
             "Name a ship that could dock here.", "How many piers are there?"]
PARAMS = SamplingParams(max_tokens=10)


def make_pair(default_engine, decode_pages: int, prefill_pages: int):
    registry: dict = {}
    layout = default_engine.cache.layout
    d_engine = Engine(default_engine.model, default_engine.tokenizer, KVCache(layout, decode_pages),
                      identity=default_engine.identity)
    host = PoolHost(d_engine.cache, ("inproc",), registry)
    decode = DecodeWorker(d_engine, host, transfer_timeout_s=10.0).launch()
    p_engine = Engine(default_engine.model, default_engine.tokenizer, None, identity=default_engine.identity)
    p_engine.attach_pool(prefill_pages)
    prefill = PrefillWorker(p_engine, pass_tokens=256, registry=registry).launch()
    return prefill, decode, host


@pytest.fixture
def cached_pair(default_engine):
    prefill, decode, host = make_pair(default_engine, 256, 256)
    yield prefill, decode
    prefill.close()
    decode.close()
    host.close()
    assert decode.engine.allocator.num_used == 0 and prefill.engine.allocator.num_used == 0, "leaked pages"


def chat(tokenizer, question: str, system: str = SYSTEM) -> list[int]:
    return tokenizer.encode_chat([ChatMessage("system", system), ChatMessage("user", question)])


def handoff(prefill, decode, ids, rid, params=PARAMS):
    """One request through both workers; (tokens, Reserved, Prefilled)."""
    reserved, dsink = reserve(decode, ids, params, rid)
    first = prefill_into(prefill, ids, params, rid, reserved).replies[0]
    assert isinstance(first, Prefilled), first
    decode.start(Start(rid, reserved.lease, first.token, first.logprob))
    assert dsink.finished.wait(60) and dsink.error is None, dsink.error
    return [first.token] + dsink.tokens, reserved, first


def shared_pages(a: list[int], b: list[int], tpp: int) -> int:
    """Full pages two prompts share that the cache may serve (never the one holding the last token)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(n, len(b) - 1) // tpp


def test_a_shared_prefix_is_reused_on_both_sides_and_only_the_missing_pages_move(default_engine, cached_pair):
    prefill, decode = cached_pair
    tok, tpp, bpt = default_engine.tokenizer, default_engine.tokens_per_page, default_engine.kv_layout().bytes_per_token
    first_ids, second_ids = chat(tok, QUESTIONS[0]), chat(tok, QUESTIONS[1])
    got1, r1, p1 = handoff(prefill, decode, first_ids, "a")
    assert r1.cached_tokens == 0 and p1.cached_tokens == 0 and p1.kv_bytes == len(first_ids) * bpt
    got2, r2, p2 = handoff(prefill, decode, second_ids, "b")
    hit = shared_pages(first_ids, second_ids, tpp) * tpp
    assert hit >= 2 * tpp  # the system prompt spans several pages
    assert r2.cached_tokens == hit and r2.destination.start == hit and p2.cached_tokens == hit
    assert p2.kv_bytes == (len(second_ids) - hit) * bpt  # only the pages the decode worker lacks
    assert got1 == complete(default_engine, first_ids, PARAMS).output_ids
    assert got2 == complete(default_engine, second_ids, PARAMS).output_ids
    stats = decode.stats()
    assert stats.cache_hits == hit // tpp and stats.pages_cached > 0 and stats.engine_salt == default_engine.salt.hex()


def test_each_side_sends_or_computes_what_the_other_lacks(default_engine, cached_pair):
    """Decode lacks what prefill has cached: prefill sends those pages from its cache. Prefill lacks what
    decode has: it computes them but writes only the rest. Outputs are exact either way."""
    prefill, decode = cached_pair
    tok, tpp, bpt = default_engine.tokenizer, default_engine.tokens_per_page, default_engine.kv_layout().bytes_per_token
    ids = [chat(tok, q) for q in QUESTIONS[:3]]
    handoff(prefill, decode, ids[0], "warm")
    decode.flush()
    got, r, p = handoff(prefill, decode, ids[1], "decode-cold")
    hit = shared_pages(ids[0], ids[1], tpp) * tpp
    assert r.cached_tokens == 0 and p.cached_tokens == hit and p.kv_bytes == len(ids[1]) * bpt
    assert got == complete(default_engine, ids[1], PARAMS).output_ids
    prefill.flush()
    got, r, p = handoff(prefill, decode, ids[2], "prefill-cold")
    hit = shared_pages(ids[1], ids[2], tpp) * tpp
    assert p.cached_tokens == 0 and r.cached_tokens == hit and p.kv_bytes == (len(ids[2]) - hit) * bpt
    assert got == complete(default_engine, ids[2], PARAMS).output_ids


def test_a_local_prefill_reuses_the_cache_and_never_writes_a_shared_page(default_engine, cached_pair):
    """A prompt that diverges inside a page: the shared full pages are reused, the diverging page is
    the request's own. The shared pages' K/V are bit-for-bit unchanged by a second request using them."""
    _, decode = cached_pair
    tok, tpp = default_engine.tokenizer, default_engine.tokens_per_page
    base = chat(tok, QUESTIONS[3])
    diverging = base[:-tpp // 2] + tok.encode(" Answer in French, please.")  # differs inside the last pages
    sink = ListSink()
    decode.open(Open("first", base, PARAMS, local_prefill=True), sink)
    assert sink.finished.wait(60) and sink.tokens == complete(default_engine, base, PARAMS).output_ids
    assert wait_until(lambda: decode.stats().pages_used == 0)
    n_shared = shared_pages(base, diverging, tpp)
    a = decode.engine.allocator
    with decode.lock:  # which pages hold the shared prefix now
        pages = a.match(page_hashes(base, tpp, decode.engine.salt)[:n_shared])
        a.free(pages)
        before = decode.engine.cache.data[:, :, pages].clone()
    assert len(pages) == n_shared
    sink = ListSink()
    decode.open(Open("second", diverging, PARAMS, local_prefill=True), sink)
    assert sink.finished.wait(60)
    assert sink.replies[0].cached_tokens == n_shared * tpp > 0  # reported on the first token
    assert sink.tokens == complete(default_engine, diverging, PARAMS).output_ids
    assert wait_until(lambda: decode.stats().pages_used == 0)
    assert decode.engine.cache.data[:, :, pages].equal(before)


def test_eviction_under_pools_too_small_for_the_working_set(default_engine):
    """Three families of prompts sharing system prompts, sent concurrently through pools that cannot hold
    them all: cached pages are evicted (LRU) while requests share others. No output changes, nothing
    leaks, and the allocator's books add up."""
    prefill, decode, host = make_pair(default_engine, decode_pages=32, prefill_pages=14)
    tok = default_engine.tokenizer
    systems = [SYSTEM, SYSTEM.replace("harbor", "mountain"), SYSTEM.replace("copper", "amber")]
    prompts = [chat(tok, q, s) for s in systems for q in QUESTIONS]
    expected = [complete(default_engine, ids, PARAMS).output_ids for ids in prompts]
    results: list[tuple[int, list[int]]] = []
    ids = itertools.count()

    def client(indices: list[int]) -> None:
        for i in indices:
            while True:
                try:
                    results.append((i, handoff(prefill, decode, prompts[i], f"r{i}-{next(ids)}")[0]))
                    break
                except OutOfPages:  # the pool is full of running requests: try again, as the router would
                    wait_until(lambda: decode.stats().pages_used <= 32 - 8, 5)
    try:
        order = list(range(len(prompts))) * 2  # every prompt twice: hits, after evictions too
        threads = [threading.Thread(target=client, args=(order[k::4],)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(results) == len(order)
        assert [(i, got) for i, got in results if got != expected[i]] == []
        a = decode.engine.allocator
        assert wait_until(lambda: decode.stats().pages_used == 0)
        states = [a.page_state(p) for p in range(a.num_pages)]
        c = a.counters()
        assert c.evicted_pages > 0 and c.hit_pages > 0  # it did evict, and it did reuse
        assert states.count(PageState.CACHED) == c.cached_pages == decode.stats().pages_cached
        assert states.count(PageState.USED) == 0 and len(a.held_hashes()) == c.cached_pages
        assert prefill.engine.allocator.counters().evicted_pages > 0 and prefill.engine.allocator.num_used == 0
    finally:
        prefill.close()
        decode.close()
        host.close()


def test_every_watcher_sees_every_change_or_a_snapshot(default_engine, cached_pair):
    """Two watchers from the start and one that joins late: each one's pushes, applied in order, give
    exactly the set of hashes the pool holds."""
    prefill, decode = cached_pair
    tok = default_engine.tokenizer
    sinks = [ListSink(), ListSink()]
    for s in sinks:
        decode.watch(s, heartbeat_s=0.05)
    for i, q in enumerate(QUESTIONS[:2]):
        handoff(prefill, decode, chat(tok, q), f"w{i}")
    late = ListSink()
    decode.watch(late, heartbeat_s=0.05)
    handoff(prefill, decode, chat(tok, QUESTIONS[2]), "w2")
    decode.flush()
    handoff(prefill, decode, chat(tok, QUESTIONS[3]), "w3")
    held = set(decode.engine.allocator.held_hashes())
    assert held
    for sink in (*sinks, late):
        view = PrefixView(default_engine.tokens_per_page)
        assert wait_until(lambda: _follow(view, sink, held), 5)
        sink.gone = True
    assert any(r.resync for r in late.replies if isinstance(r, WorkerStats))


def _follow(view: PrefixView, sink: ListSink, held: set[bytes]) -> bool:
    """Whether a view that applied every push so far believes the worker holds exactly `held`."""
    view.forget("d")
    for r in list(sink.replies):
        if isinstance(r, WorkerStats):
            view.observe("d", r)
    return view.index.num_hashes("d") == len(held) and all(view.index.matched_pages("d", [h]) for h in held)
