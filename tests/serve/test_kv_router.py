"""KV-aware routing and conditional disaggregation: the choice follows what each worker caches (as its
stats pushes say, through the PrefixView) against its load; bad reports never break routing."""

from __future__ import annotations

import pytest

from control.fleet import WorkerState
from control.prefix_index import PrefixView
from control.router import Demand, KvAware, LeastLoaded, NoWorker
from tandem.prefix import engine_salt, page_hashes
from tandem.wire import WorkerStats

TPP = 16
SALT = engine_salt("sha256:test", {"tokens_per_page": TPP})
CONVERSATION = list(range(1000, 1000 + 40 * TPP))  # 640 tokens: a long conversation so far
NEXT_TURN = CONVERSATION + list(range(5000, 5040))  # + 40 new tokens


def worker(view: PrefixView, name: str, role: str, holds: list[int] = (), running: int = 0, queued: int = 0,
           free: int = 1000) -> WorkerState:
    w = WorkerState(name, role, "unused:1", client=None, healthy=True, running=running)
    w.stats = WorkerStats(role=role, pages_total=free, pages_used=0, queued_tokens=queued, resync=True,
                          stored=[h.hex() for h in page_hashes(list(holds), TPP, SALT)], engine_salt=SALT.hex())
    view.observe(name, w.stats)
    return w


def demand(view: PrefixView, ids: list[int], local_max: int = 0) -> Demand:
    lookup = view.lookup(ids)
    return Demand(len(ids), -(-(len(ids) + 32) // TPP), TPP, lambda w: lookup.tokens(w.name), local_max)


def test_the_view_counts_leading_cached_tokens_but_never_the_last_one():
    view = PrefixView(TPP)
    worker(view, "d0", "decode", holds=CONVERSATION)
    assert view.lookup(NEXT_TURN).tokens("d0") == len(CONVERSATION)
    assert view.lookup(CONVERSATION).tokens("d0") == len(CONVERSATION) - TPP  # its last token is computed
    assert view.lookup(list(range(7, 900))).tokens("d0") == 0 and view.lookup(NEXT_TURN).tokens("nobody") == 0


def test_kv_aware_goes_where_the_conversation_is_cached_and_prefills_it_there():
    view = PrefixView(TPP)
    d0 = worker(view, "d0", "decode", running=1)
    d1 = worker(view, "d1", "decode", holds=CONVERSATION, running=2)
    p0 = worker(view, "p0", "prefill")
    d, p = KvAware().pick_pair([p0], [d0, d1], demand(view, NEXT_TURN, local_max=64))
    assert (d.name, p) == ("d1", None)  # 40 tokens to compute on d1 instead of 680 anywhere else
    d, p = LeastLoaded().pick_pair([p0], [d0, d1], demand(view, NEXT_TURN, local_max=64))
    assert (d.name, p.name) == ("d0", "p0")  # cache-blind: the least busy, and a full prefill


def test_kv_aware_weighs_the_prefill_cache_against_its_queue():
    view = PrefixView(TPP)
    d0 = worker(view, "d0", "decode")
    warm = worker(view, "p-warm", "prefill", holds=CONVERSATION, queued=200)
    cold = worker(view, "p-cold", "prefill")
    d, p = KvAware().pick_pair([warm, cold], [d0], demand(view, NEXT_TURN))
    assert p.name == "p-warm"  # 200 queued + 40 to compute beats 680 to compute
    warm.stats = WorkerStats(**{**warm.stats.__dict__, "queued_tokens": 5000, "stored": [], "resync": False})
    d, p = KvAware().pick_pair([warm, cold], [d0], demand(view, NEXT_TURN))
    assert p.name == "p-cold"


def test_a_busy_holder_or_one_without_room_loses_the_request():
    view = PrefixView(TPP)
    d0 = worker(view, "d0", "decode")
    busy = worker(view, "busy", "decode", holds=CONVERSATION, running=40)
    p0 = worker(view, "p0", "prefill")
    assert KvAware().pick_pair([p0], [d0, busy], demand(view, NEXT_TURN))[0].name == "d0"
    full = worker(view, "full", "decode", holds=CONVERSATION, free=1)  # it lacks pages even for the rest
    assert KvAware().pick_pair([p0], [d0, full], demand(view, NEXT_TURN, local_max=64))[0].name == "d0"
    with pytest.raises(NoWorker):
        KvAware().pick_pair([p0], [], demand(view, NEXT_TURN))


def test_conditional_disaggregation_follows_the_threshold():
    view = PrefixView(TPP)
    d0 = worker(view, "d0", "decode", holds=CONVERSATION)
    p0 = worker(view, "p0", "prefill")
    for router in (LeastLoaded(), KvAware()):
        assert router.pick_pair([p0], [d0], demand(view, NEXT_TURN, local_max=40))[1] is None
        assert router.pick_pair([p0], [d0], demand(view, NEXT_TURN, local_max=39))[1] is p0
        assert router.pick_pair([p0], [d0], demand(view, NEXT_TURN, local_max=0))[1] is p0
        assert router.pick_pair([], [d0], demand(view, NEXT_TURN))[1] is None  # co-located: always itself


@pytest.mark.parametrize("bad", [{"stored": ["zz" * 16]}, {"stored": ["ab"]}, {"engine_salt": "nothex"},
                                 {"resync": False, "stored": ["ab" * 16], "removed": ["ab" * 16]}])
def test_a_malformed_report_makes_the_view_forget_the_worker(bad):
    view = PrefixView(TPP)
    w = worker(view, "d0", "decode", holds=CONVERSATION)
    view.observe("d0", WorkerStats(**{**w.stats.__dict__, **bad}))
    assert view.lookup(NEXT_TURN).tokens("d0") == 0 and "d0" not in view.salts


def test_a_worker_with_its_cache_off_holds_nothing_and_a_snapshot_replaces():
    view = PrefixView(TPP)
    w = worker(view, "d0", "decode", holds=CONVERSATION)
    view.observe("d0", WorkerStats(role="decode", resync=True, stored=[h.hex() for h in page_hashes(NEXT_TURN, TPP, SALT)[:3]],
                                   engine_salt=SALT.hex()))
    assert view.lookup(NEXT_TURN).tokens("d0") == 3 * TPP
    view.observe("d0", WorkerStats(role="decode", engine_salt=""))
    assert view.lookup(NEXT_TURN).tokens("d0") == 0 and w.name not in view.salts
