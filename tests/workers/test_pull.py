"""The pull handoff in the workers (one process, inproc transport, real model): prefill holds the K/V
in its own pool, decode reads them; outputs are exact, a hold lives exactly as long as its request
(no timer), and the fence keeps a late reader from reading pages the prefill worker gave back."""

from __future__ import annotations

import time

import pytest

from engine.engine import Engine
from engine.kv_pool import KVCache
from engine.tokenizer import ChatMessage
from engine.transports.fence import FenceGuard
from engine.transports.host import PoolHost
from engine.transports.pull import reader
from engine.workers.decode_worker import DecodeWorker
from engine.workers.prefill_worker import PrefillWorker
from tandem.sampling_params import SamplingParams
from tandem.status import LeaseLost, ProtocolError, Status, status_of
from tandem.wire import Ack, Open, Prefill, Prefilled, Pulled, Release, Token
from tests.conftest import complete
from tests.workers.test_handoff import PROMPTS, ListSink, wait_until
from tests.workers.test_prefix_handoff import QUESTIONS, SYSTEM, chat

PARAMS = SamplingParams(max_tokens=10)


class PullPair:
    def __init__(self, default_engine, prefill_pages: int = 256, decode_pages: int = 256):
        self.registry: dict = {}
        layout = self.layout = default_engine.cache.layout
        model, tok, ident = default_engine.model, default_engine.tokenizer, default_engine.identity
        self.d_engine = Engine(model, tok, KVCache(layout, decode_pages), identity=ident)
        self.d_host = PoolHost(self.d_engine.cache, ("inproc",), self.registry)
        self.decode = DecodeWorker(self.d_engine, self.d_host, transfer_timeout_s=10.0, registry=self.registry).launch()
        self.p_engine = Engine(model, tok, KVCache(layout, prefill_pages), identity=ident)
        self.p_host = PoolHost(self.p_engine.cache, ("inproc",), self.registry)
        self.prefill = PrefillWorker(self.p_engine, pass_tokens=256, pool=self.p_host).launch()

    def prefill_held(self, ids, rid, params=PARAMS) -> tuple[Prefilled, ListSink]:
        sink = ListSink()
        self.prefill.submit(Prefill(rid, ids, params, pull=True), sink)
        assert wait_until(lambda: sink.replies or sink.done, 60), "no answer from the prefill worker"
        assert sink.replies and isinstance(sink.replies[0], Prefilled), sink.error
        return sink.replies[0], sink

    def run(self, ids, rid, params=PARAMS) -> tuple[list[int], Prefilled, Pulled]:
        """One request the way the orchestrator runs it in pull mode."""
        first, psink = self.prefill_held(ids, rid, params)
        dsink = ListSink()
        self.decode.open(Open(rid, ids, params, source=first.source), dsink)
        assert wait_until(lambda: dsink.replies or dsink.done, 30) and dsink.error is None, dsink.error
        pulled = dsink.replies[0]
        assert isinstance(pulled, Pulled)
        assert self.prefill.unhold(rid, first.source.hold).found
        assert psink.finished.wait(5) and isinstance(psink.replies[-1], Ack)  # the held call ends with its hold
        assert dsink.finished.wait(60) and dsink.error is None, dsink.error
        self.streamed = [r for r in dsink.replies if isinstance(r, Token) and r.token is not None]
        return [first.token] + dsink.tokens, first, pulled

    def close(self) -> None:
        assert wait_until(lambda: not self.decode.inbox), "the decode loop never applied its last notices"
        self.prefill.close()
        self.decode.close()
        self.p_host.close()
        self.d_host.close()


@pytest.fixture
def pull_pair(default_engine):
    p = PullPair(default_engine)
    yield p
    p.close()
    assert p.d_engine.allocator.num_used == 0 and p.p_engine.allocator.num_used == 0, "leaked pages"


def test_pull_carries_logprobs_and_penalized_samples_as_one_engine_computes_them(default_engine, pull_pair):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=11, repetition_penalty=1.3, logprobs=True,
                            top_logprobs=2, prompt_logprobs=True)
    ids = default_engine.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    want = complete(default_engine, ids, params)
    out, first, _ = pull_pair.run(ids, "r", params)
    assert out == want.output_ids  # the penalty and the seeded sampler read the same history after the read
    assert [r.logprob for r in first.prompt_logprobs] == [r.logprob for r in want.prompt_logprobs]  # bit for bit
    assert len(first.top.top_ids) == 2
    streamed = pull_pair.streamed
    assert [first.logprob] + [t.logprob for t in streamed] == want.output_logprobs
    assert all(len(t.top.top_ids) == 2 and not t.prompt_logprobs for t in streamed)


def test_pull_greedy_equals_single_engine_short_and_chunked_prompts(default_engine, pull_pair):
    tok = default_engine.tokenizer
    prompts = [tok.encode_chat([ChatMessage("user", p)]) for p in PROMPTS]
    prompts.append(tok.encode_chat([ChatMessage("user", " ".join(["Tell me about the harbor."] * 60))]))
    assert len(prompts[-1]) > pull_pair.prefill.pass_tokens  # prefilled in chunks, then held
    for i, ids in enumerate(prompts):
        got, first, pulled = pull_pair.run(ids, f"r{i}")
        assert got == complete(default_engine, ids, PARAMS).output_ids
        assert first.source.tokens == len(ids) and pulled.kv_bytes > 0
    assert wait_until(lambda: pull_pair.prefill.stats().pages_held == 0 and pull_pair.decode.stats().pages_used == 0)


def test_a_hold_lives_as_long_as_its_request_and_an_abort_ends_it(default_engine, pull_pair):
    ids = default_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    first, psink = pull_pair.prefill_held(ids, "patient")
    held = len(first.source.page_ids)
    time.sleep(1.5)  # longer than the hold sweep's period: a live caller keeps its hold (there is no timer)
    assert pull_pair.prefill.stats().pages_held == held and not psink.done
    assert pull_pair.prefill.abort("patient").found
    assert status_of(psink.error) is Status.CANCELLED
    assert pull_pair.prefill.stats().pages_held == 0 and pull_pair.p_engine.allocator.num_used == 0


def test_a_hold_whose_caller_went_away_ends(default_engine, pull_pair):
    first, psink = pull_pair.prefill_held(default_engine.tokenizer.encode("Name a color."), "gone")
    psink.gone = True  # Triton marks the call cancelled (an orchestrator that died)
    assert wait_until(lambda: pull_pair.prefill.stats().pages_held == 0, 5)
    assert pull_pair.p_engine.allocator.num_used == 0


def test_only_the_holder_can_end_a_hold_and_bad_pull_calls_are_refused(default_engine, pull_pair):
    ids = default_engine.tokenizer.encode("Count from one to five.")
    first, psink = pull_pair.prefill_held(ids, "mine")
    with pytest.raises(ProtocolError, match="hold id"):
        pull_pair.prefill.unhold("mine", "0" * 16)
    assert pull_pair.prefill.stats().pages_held == len(first.source.page_ids)
    assert not pull_pair.prefill.unhold("nobody", first.source.hold).found
    bad = ListSink()
    with pytest.raises(ProtocolError, match="must cover the prompt"):
        pull_pair.decode.open(Open("mine", ids[:-1], PARAMS, source=first.source), bad)
    assert pull_pair.prefill.unhold("mine", first.source.hold).found
    plain = PrefillWorker(pull_pair.p_engine, pool=None)  # a worker that exports no pool refuses pull
    with pytest.raises(ProtocolError, match="exports its pool"):
        plain.submit(Prefill("x", ids, PARAMS, pull=True), ListSink())


def test_the_fence_keeps_a_late_reader_out_of_pages_given_back(default_engine, pull_pair):
    """A reader in the middle of a copy (holding the slot's read lock, as a reader stopped there would)
    keeps the held pages out of use after the hold ends; once it is out they are free, and a read that
    starts after the revoke fails LEASE_LOST having read nothing (without the fence it would read pages
    that another request may own by then)."""
    p = pull_pair
    first, psink = p.prefill_held(default_engine.tokenizer.encode("Write a haiku about rain."), "old")
    src = first.source
    guard = FenceGuard(p.registry[src.pool.inproc.id].fence_name)
    try:
        with guard.hold(src.slot, src.epoch):
            assert p.prefill.unhold("old", src.hold).found
            time.sleep(0.3)
            assert p.prefill.stats().pages_held == len(src.page_ids)  # revoking: the read in flight holds them
            assert all(p.p_engine.allocator.refcount(pg) > 0 for pg in src.page_ids)
        assert wait_until(lambda: p.prefill.stats().pages_held == 0, 5)
    finally:
        guard.close()
    local = KVCache(p.layout, 16)
    with pytest.raises(LeaseLost, match="revoked"):
        reader("inproc", p.layout, p.registry).read(src, local, list(range(len(src.page_ids))))
    assert not local.data.any()
    # the decode worker opened with the stale source: LEASE_LOST, and its own pages come back
    dsink = ListSink()
    p.decode.open(Open("old", default_engine.tokenizer.encode("Write a haiku about rain."), PARAMS, source=src), dsink)
    assert dsink.finished.wait(10) and status_of(dsink.error) is Status.LEASE_LOST
    assert wait_until(lambda: p.d_engine.allocator.num_used == 0)


def test_a_first_token_that_ends_the_request_holds_nothing(default_engine, pull_pair):
    ids = default_engine.tokenizer.encode("Name a ship that could dock in a harbor with three piers.")
    assert complete(default_engine, ids, PARAMS).output_ids == [2]  # this model ends it at once (EOS)
    first, psink = pull_pair.prefill_held(ids, "short")
    assert first.finish_reason == "stop" and first.source is None and psink.done
    assert pull_pair.prefill.stats().pages_held == 0 and pull_pair.p_engine.allocator.num_used == 0


def test_a_release_while_pulling_frees_the_decode_pages(default_engine, pull_pair):
    ids = chat(default_engine.tokenizer, "Name a ship that could dock here.")
    first, psink = pull_pair.prefill_held(ids, "quit")
    dsink = ListSink()
    pull_pair.decode.open(Open("quit", ids, PARAMS, source=first.source), dsink)
    pull_pair.decode.release(Release("quit"))
    assert dsink.finished.wait(10)
    assert wait_until(lambda: pull_pair.d_engine.allocator.num_used == 0)
    assert pull_pair.prefill.unhold("quit", first.source.hold).found


def test_a_shared_prefix_is_read_only_where_the_decode_cache_lacks_it(default_engine, pull_pair):
    tok, tpp = default_engine.tokenizer, pull_pair.layout.tokens_per_page
    prompts = [chat(tok, q) for q in QUESTIONS[:3]]
    pulled = []
    for i, ids in enumerate(prompts):
        got, first, p = pull_pair.run(ids, f"c{i}")
        assert got == complete(default_engine, ids, PARAMS).output_ids
        pulled.append(p)
    assert pulled[0].cached_tokens == 0
    assert all(p.cached_tokens >= len(chat(tok, "", SYSTEM)) // tpp * tpp - tpp for p in pulled[1:])
    assert all(p.kv_bytes < pulled[0].kv_bytes for p in pulled[1:])  # only the pages the cache lacked
    assert pull_pair.prefill.stats().cache_hits > 0  # the prefill side reused its own cache too


def test_a_read_that_raises_fails_its_request_and_the_next_read_works(default_engine, pull_pair, monkeypatch):
    """A fault no real reader here can be made to show (a device out of memory in a cuda_ipc read): the
    reader raises something that is not a Tandem status. That request fails with TRANSFER_FAILED and
    its decode pages are freed; the pull thread lives on, and the next request is read and decoded."""
    ids = default_engine.tokenizer.encode_chat([ChatMessage("user", PROMPTS[0])])
    first, psink = pull_pair.prefill_held(ids, "oom")
    real = reader("inproc", pull_pair.layout, pull_pair.registry)
    pull_pair.decode.puller.readers["inproc"] = real

    def fail(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (a fault injected by this test)")
    monkeypatch.setattr(real, "read", fail)
    dsink = ListSink()
    pull_pair.decode.open(Open("oom", ids, PARAMS, source=first.source), dsink)
    assert dsink.finished.wait(10) and status_of(dsink.error) is Status.TRANSFER_FAILED
    assert "RuntimeError: CUDA out of memory" in str(dsink.error)
    assert wait_until(lambda: pull_pair.d_engine.allocator.num_used == 0)
    assert pull_pair.prefill.unhold("oom", first.source.hold).found
    monkeypatch.undo()
    assert pull_pair.run(ids, "next")[0] == complete(default_engine, ids, PARAMS).output_ids
