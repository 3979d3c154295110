"""The pull handoff over NIXL READ in the workers (one process, two real NIXL agents over UCX, real
model): outputs are exact, and the bounded fence of a one-sided reader holds deterministically:
- a read that starts after the hold ended reads nothing (the epoch it READs first is gone) and its
  `closed` notice gives the pages back;
- a reader already past its epoch check when the hold ends keeps the pages out of use, reads the K/V
  of its own request (never another's), and its notice gives them back;
- a decode lease that ends before its read starts (a cancel racing the Open), and an Open refused for
  want of pages, still send the notice;
- an ended hold nobody reports on comes back after the fence timeout; one ended with `reader_closed`
  comes back at once."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.kv_pool import KVCache
from engine.transports.host import PoolHost
from engine.transports.nixl import available as nixl_available
from engine.transports.pull_nixl import NixlReader
from engine.workers.decode_worker import DecodeWorker
from engine.workers.prefill_worker import PrefillWorker
from tandem.pool import host_identity
from tandem.sampling_params import SamplingParams
from tandem.status import LeaseLost, OutOfPages
from tandem.wire import Open, Prefill, Prefilled, Pulled
from tests.conftest import complete
from tests.workers.test_handoff import ListSink, wait_until
from tests.workers.test_prefix_handoff import chat

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed (pip install --no-deps nixl-cu12)")
PARAMS = SamplingParams(max_tokens=10)


class NixlPullPair:
    def __init__(self, default_engine, fence_timeout_s: float = 600.0):
        layout = self.layout = default_engine.cache.layout
        model, tok, ident = default_engine.model, default_engine.tokenizer, default_engine.identity
        self.d_engine = Engine(model, tok, KVCache(layout, 128), identity=ident)
        self.d_host = PoolHost(self.d_engine.cache, ("nixl",))
        self.decode = DecodeWorker(self.d_engine, self.d_host, transfer_timeout_s=10.0).launch()
        self.p_engine = Engine(model, tok, KVCache(layout, 128), identity=ident)
        self.p_host = PoolHost(self.p_engine.cache, ("nixl",))
        self.prefill = PrefillWorker(self.p_engine, pass_tokens=256, pool=self.p_host,
                                     fence_timeout_s=fence_timeout_s).launch()

    def held(self, ids, rid) -> Prefilled:
        sink = ListSink()
        self.prefill.submit(Prefill(rid, ids, PARAMS, pull=True, reader_host=host_identity()), sink)
        assert wait_until(lambda: sink.replies or sink.done, 60), "no answer from the prefill worker"
        first = sink.replies[0]
        assert isinstance(first, Prefilled) and first.source.transport == "nixl", sink.error
        return first

    def pages_held(self) -> int:
        return self.prefill.stats().pages_held

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.p_host.close()
        self.d_host.close()


@pytest.fixture
def pair(default_engine):
    p = NixlPullPair(default_engine)
    yield p
    p.close()


def test_pull_over_nixl_read_equals_one_engine(default_engine, pair):
    for i, q in enumerate(["Name a ship that could dock here.", "Write a haiku about rain."]):
        ids = chat(default_engine.tokenizer, q)
        first = pair.held(ids, f"r{i}")
        dsink = ListSink()
        pair.decode.open(Open(f"r{i}", ids, PARAMS, source=first.source), dsink)
        assert dsink.finished.wait(60) and dsink.error is None, dsink.error
        assert isinstance(dsink.replies[0], Pulled) and dsink.replies[0].kv_bytes > 0
        assert [first.token] + dsink.tokens == complete(default_engine, ids, PARAMS).output_ids
        assert pair.prefill.unhold(f"r{i}", first.source.hold, reader_closed=True).found
        assert wait_until(lambda: pair.pages_held() == 0, 5)  # said closed: back at once, no notice awaited
    assert pair.prefill.holds.fence_timeouts == 0


def test_a_read_after_the_hold_ended_reads_nothing_and_its_notice_frees_the_pages(default_engine, pair):
    src = pair.held(chat(default_engine.tokenizer, "Count from one to five."), "late").source
    assert pair.prefill.unhold("late", src.hold).found  # not reader_closed: a reader might still read
    assert pair.pages_held() == len(src.page_ids)  # REVOKING: the one-sided fence waits for the reader
    local, r = KVCache(pair.layout, 16), NixlReader(pair.layout)
    try:
        with pytest.raises(LeaseLost, match="hold on the source pages ended"):
            r.read(src, local, list(range(len(src.page_ids))))
    finally:
        r.close()
    assert not local.data.any()
    assert wait_until(lambda: pair.pages_held() == 0, 10)  # its closed notice arrived
    assert pair.prefill.holds.fence_timeouts == 0 and pair.p_engine.allocator.num_used == 0


class PausingReader(NixlReader):
    """A real NIXL reader that runs `between()` after its epoch READ and before its page READ: the window
    a reader stopped there (SIGSTOP, a slow host) would leave open."""

    def __init__(self, layout, between):
        super().__init__(layout)
        self.between, self.transfers = between, 0

    def _transfer(self, *args):
        if self.transfers == 1:
            self.between()
        self.transfers += 1
        return super()._transfer(*args)


def test_a_reader_past_its_epoch_check_reads_its_own_request_and_holds_the_pages_until_done(default_engine, pair):
    tok = default_engine.tokenizer
    src = pair.held(tok.encode("The quick brown fox jumps over the lazy dog, and then the dog"), "old").source
    want = pair.p_engine.cache.data[:, :, src.page_ids].clone()  # [layers, 2, P, tpp, Hkv, hd]
    seen = {}

    def hold_ends_meanwhile():
        assert pair.prefill.unhold("old", src.hold).found
        seen["held"] = pair.pages_held()
        seen["refs"] = [pair.p_engine.allocator.refcount(p) for p in src.page_ids]
        other = pair.held(tok.encode("The capital of France is Paris. The capital of Germany is"), "other")  # no shared prefix
        seen["other"] = set(other.source.page_ids)
        assert pair.prefill.unhold("other", other.source.hold, reader_closed=True).found

    local, r = KVCache(pair.layout, 16), PausingReader(pair.layout, hold_ends_meanwhile)
    try:
        r.read(src, local, list(range(len(src.page_ids))))
    finally:
        r.close()
    assert seen["held"] == len(src.page_ids) and all(n > 0 for n in seen["refs"])  # kept out of use ...
    assert not seen["other"] & set(src.page_ids)  # ... so no other request was given them
    assert torch.equal(local.data[:, :, :len(src.page_ids)], want)  # what it read is its own request's K/V
    assert wait_until(lambda: pair.pages_held() == 0, 10)  # and its notice gave them back
    assert pair.prefill.holds.fence_timeouts == 0 and pair.p_engine.allocator.num_used == 0


def test_a_lease_ended_before_its_read_started_still_tells_the_source(default_engine, pair):
    """The orchestrator opened the decode worker, then the client left: the lease ends before the loop
    hands it to the reader, and the Unhold cannot say `reader_closed` (a read might be in flight). The
    reader still sends its `closed` notice, having read nothing: the pages need not wait for the fence
    timeout (600 s here)."""
    src = pair.held(chat(default_engine.tokenizer, "Name a color."), "left").source
    sink = ListSink()
    sink.gone = True  # the Open's caller is gone before the loop sees the lease
    pair.decode.open(Open("left", chat(default_engine.tokenizer, "Name a color."), PARAMS, source=src), sink)
    assert pair.prefill.unhold("left", src.hold).found  # not reader_closed: the orchestrator cannot know
    assert wait_until(lambda: pair.pages_held() == 0, 10)  # the notice arrived
    assert not sink.replies and pair.prefill.holds.fence_timeouts == 0
    assert wait_until(lambda: pair.d_engine.allocator.num_used == 0, 10)  # the decode pages came back too


def test_an_open_refused_for_want_of_pages_still_tells_the_source(default_engine, pair):
    """The decode worker has no room (OUT_OF_PAGES, refused before any lease exists) and the orchestrator,
    gone before that answer came, cannot say `reader_closed`: the decode worker says it instead."""
    ids = chat(default_engine.tokenizer, "Name a color.")
    src = pair.held(ids, "full").source
    big = SamplingParams(max_tokens=pair.layout.tokens_per_page * 128)  # more pages than the decode pool has
    with pytest.raises(OutOfPages):
        pair.decode.open(Open("full", ids, big, source=src), ListSink())
    assert pair.prefill.unhold("full", src.hold).found  # not reader_closed
    assert wait_until(lambda: pair.pages_held() == 0, 10)  # the notice arrived
    assert pair.prefill.holds.fence_timeouts == 0 and pair.d_engine.allocator.num_used == 0


def test_an_ended_hold_nobody_reports_on_comes_back_after_the_fence_timeout(default_engine):
    pair = NixlPullPair(default_engine, fence_timeout_s=0.5)
    try:
        src = pair.held(chat(default_engine.tokenizer, "Name a color."), "silent").source
        assert pair.prefill.unhold("silent", src.hold).found  # not reader_closed: a reader may have it
        assert pair.pages_held() == len(src.page_ids)
        assert wait_until(lambda: pair.pages_held() == 0, 10)
        assert pair.prefill.holds.fence_timeouts == 1 and pair.p_engine.allocator.num_used == 0
    finally:
        pair.close()


def test_an_abort_ends_a_nixl_hold_at_once(default_engine, pair):
    """The orchestrator aborts a pull prefill only before it saw the source: no reader can have it."""
    src = pair.held(chat(default_engine.tokenizer, "Name a color."), "aborted").source
    assert pair.prefill.abort("aborted").found
    assert pair.pages_held() == 0 and pair.prefill.holds.fence_timeouts == 0
    assert len(src.page_ids) > 0 and pair.p_engine.allocator.num_used == 0


def test_a_dead_readers_holds_come_back_without_its_notice(default_engine, pair):
    """ReaderGone (the supervisor saw the decode worker die): nothing of it can be in flight."""
    tok = default_engine.tokenizer
    first = pair.held(chat(tok, "Name a color."), "a")
    sink = ListSink()
    pair.prefill.submit(Prefill("b", chat(tok, "Write a haiku about rain."), PARAMS, pull=True,
                                reader_host=host_identity(), reader="decode-7"), sink)
    assert wait_until(lambda: sink.replies, 60) and sink.replies[0].source is not None
    second = sink.replies[0].source
    assert pair.prefill.unhold("b", second.hold).found and pair.prefill.unhold("a", first.source.hold).found
    held = pair.pages_held()
    assert held == len(first.source.page_ids) + len(second.page_ids)  # both wait for a reader's notice
    assert pair.prefill.reader_gone("decode-7").found
    assert pair.pages_held() == len(first.source.page_ids)  # only the dead reader's hold came back
    assert pair.prefill.holds.fence_timeouts == 0
