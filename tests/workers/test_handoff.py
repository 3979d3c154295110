"""The workers in one process (inproc transport, real model): the handoff protocol as a state machine,
every exit frees the pages, and the fence keeps a late writer out of pages another request holds."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from engine.engine import Engine
from engine.errors import InvalidRequest, OutOfPages
from engine.kv_pool import KVCache
from engine.tokenizer import ChatMessage
from engine.transports import sender
from engine.transports.host import PoolHost
from engine.workers.decode_worker import DecodeWorker
from engine.workers.prefill_worker import PrefillWorker
from tandem.pool import host_identity
from tandem.sampling_params import SamplingParams
from tandem.status import Cancelled, LeaseLost, ProtocolError, Status, TransferFailed, status_of
from tandem.wire import Open, Prefill, Prefilled, Release, Reserved, Start, Token
from tests.conftest import complete

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Count from one to five.",
           "Name a color."]


class ListSink:
    """A Responder that records what a worker answers."""

    def __init__(self):
        self.replies, self.error, self.gone, self.done = [], None, False, False
        self.finished = threading.Event()

    def send(self, body, final=False):
        self.replies.append(body)
        if final:
            self.done = True
            self.finished.set()

    def fail(self, error):
        self.error, self.done = error, True
        self.finished.set()

    def cancelled(self):
        return self.gone or self.done

    @property
    def tokens(self):
        return [r.token for r in self.replies if isinstance(r, Token) and r.token is not None]


@contextlib.contextmanager
def worker_pair(default_engine, prefill_pages: int = 0, **decode_options):
    """A prefill worker (with a pool of `prefill_pages` pages of its own, or none) and a decode worker with
    an inproc pool (`decode_options`: DecodeWorker's), sharing weights; both closed after, and no decode
    page left held."""
    registry: dict = {}
    layout = default_engine.cache.layout
    decode_engine = Engine(default_engine.model, default_engine.tokenizer, KVCache(layout, 256))
    host = PoolHost(decode_engine.cache, ("inproc",), registry)
    decode = DecodeWorker(decode_engine, host, **{"transfer_timeout_s": 5.0, **decode_options}).launch()
    own = KVCache(layout, prefill_pages) if prefill_pages else None
    prefill = PrefillWorker(Engine(default_engine.model, default_engine.tokenizer, own), registry=registry).launch()
    try:
        yield prefill, decode
        # a Release is applied by the decode loop between steps: let the ones a test sent last land first
        assert wait_until(lambda: not decode.inbox), "the decode loop never applied its last notices"
    finally:
        prefill.close()
        decode.close()
        host.close()
    assert decode_engine.allocator.num_used == 0, "a test leaked decode pages"


@pytest.fixture
def pair(default_engine):
    with worker_pair(default_engine) as workers:
        yield workers


def reserve(decode, prompt_ids, params, rid):
    sink = ListSink()
    decode.open(Open(rid, prompt_ids, params, writer="p", writer_host=host_identity()), sink)
    reserved = sink.replies[0]
    assert isinstance(reserved, Reserved)
    return reserved, sink


def prefill_into(prefill, prompt_ids, params, rid, reserved, timeout=60):
    sink = ListSink()
    prefill.submit(Prefill(rid, prompt_ids, params, destination=reserved.destination), sink)
    assert sink.finished.wait(timeout)
    return sink


def run_one(prefill, decode, prompt_ids, params, rid):
    reserved, dsink = reserve(decode, prompt_ids, params, rid)
    psink = prefill_into(prefill, prompt_ids, params, rid, reserved)
    first = psink.replies[0]
    assert isinstance(first, Prefilled), psink.error
    decode.start(Start(rid, reserved.lease, first.token, first.logprob))
    assert dsink.finished.wait(60)
    return [first.token] + dsink.tokens, dsink


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_disaggregated_greedy_equals_single_engine(default_engine, pair):
    prefill, decode = pair
    params = SamplingParams(max_tokens=16)
    prompts = [default_engine.tokenizer.encode_chat([ChatMessage("user", p)]) for p in PROMPTS]
    expected = [complete(default_engine, p, params).output_ids for p in prompts]
    got = [run_one(prefill, decode, p, params, f"r{i}")[0] for i, p in enumerate(prompts)]
    assert got == expected
    assert wait_until(lambda: decode.stats().pages_used == 0)


def test_a_reservation_lives_as_long_as_its_request_however_long_the_prefill_waits(default_engine, pair):
    """No lease timer: a reservation opened long before its prefill still holds its pages."""
    prefill, decode = pair
    params = SamplingParams(max_tokens=6)
    ids = default_engine.tokenizer.encode("The quick brown fox")
    reserved, dsink = reserve(decode, ids, params, "patient")
    time.sleep(1.5)  # longer than any timeout the worker has for a reserved lease (it has none)
    assert decode.stats().reserved == 1
    first = prefill_into(prefill, ids, params, "patient", reserved).replies[0]
    decode.start(Start("patient", reserved.lease, first.token))
    assert dsink.finished.wait(60)
    assert [first.token] + dsink.tokens == complete(default_engine, ids, params).output_ids


def test_a_reservation_whose_caller_leaves_after_a_cancel_sweep_still_ends(pair):
    """The cancel sweep keeps running while leases exist: a caller that goes away after a sweep found
    it present is noticed by a later one (the loop must not sleep for good after a sweep)."""
    _, decode = pair
    reserved, dsink = reserve(decode, [1, 2, 3, 4], SamplingParams(max_tokens=4), "late-leaver")
    time.sleep(1.5)  # one sweep runs and finds the caller there
    assert not dsink.finished.is_set()
    dsink.gone = True  # no Release, no wake-up: only a sweep can find out
    assert dsink.finished.wait(10)
    assert isinstance(dsink.error, Cancelled)
    assert wait_until(lambda: decode.stats().pages_used == 0 and decode.stats().reserved == 0)


def test_pages_that_never_arrive_time_out(default_engine, pair):
    _, decode = pair
    decode.transfer_timeout_s = 0.2
    reserved, dsink = reserve(decode, [1, 2, 3], SamplingParams(max_tokens=4), "x")
    decode.start(Start("x", reserved.lease, 5))  # no prefill ever wrote or notified
    assert dsink.finished.wait(5)
    assert isinstance(dsink.error, TransferFailed) and "never arrived" in str(dsink.error)
    assert wait_until(lambda: decode.stats().pages_used == 0)


def test_release_and_cancel_stop_a_running_stream(default_engine, pair):
    prefill, decode = pair
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompt = default_engine.tokenizer.encode("Once upon a time")
    sinks = {}
    for rid in ("rel", "can"):
        reserved, dsink = reserve(decode, prompt, params, rid)
        first = prefill_into(prefill, prompt, params, rid, reserved).replies[0]
        decode.start(Start(rid, reserved.lease, first.token))
        sinks[rid] = (reserved, dsink)
    assert wait_until(lambda: len(sinks["rel"][1].tokens) >= 2 and len(sinks["can"][1].tokens) >= 2)
    decode.release(Release("rel", sinks["rel"][0].lease))
    sinks["can"][1].gone = True  # the caller vanished without a Release: the cancel sweep finds it
    assert sinks["rel"][1].finished.wait(5) and isinstance(sinks["rel"][1].error, Cancelled)
    assert wait_until(lambda: decode.stats().pages_used == 0 and decode.stats().running == 0, 5)
    assert 0 < len(sinks["rel"][1].tokens) < 100


def test_bad_calls_are_refused_and_change_nothing_else(default_engine, pair):
    _, decode = pair
    good, _ = reserve(decode, [1] * 10, SamplingParams(max_tokens=5), "good")
    before = decode.stats()
    with pytest.raises(LeaseLost, match="holds no pages here"):
        decode.start(Start("nobody", "x", 2))
    with pytest.raises(ProtocolError, match="leased to someone else"):
        decode.start(Start("good", "stolen", 2))
    with pytest.raises(ProtocolError, match="leased to someone else"):
        decode.release(Release("good", "stolen"))
    with pytest.raises(ProtocolError, match="already open"):
        decode.open(Open("good", [1], SamplingParams(max_tokens=1)), ListSink())
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        decode.open(Open("empty", [], SamplingParams(max_tokens=1)), ListSink())
    with pytest.raises(OutOfPages):
        decode.open(Open("huge", [1] * 5000, SamplingParams(max_tokens=3000)), ListSink())
    assert decode.stats() == before
    assert decode.release(Release("good", good.lease)).found
    assert wait_until(lambda: decode.stats().pages_used == 0)


def test_a_prefill_whose_destination_is_gone_fails_alone(default_engine, pair):
    prefill, decode = pair
    params = SamplingParams(max_tokens=4)
    prompt = default_engine.tokenizer.encode("Hello there")
    reserved, _ = reserve(decode, prompt, params, "ok")
    ghost = reserved.destination.__class__(**{**reserved.destination.__dict__, "pool": reserved.destination.pool.__class__(
        **{**reserved.destination.pool.__dict__, "inproc": type(reserved.destination.pool.inproc)(id="gone")})})
    with pytest.raises(TransferFailed, match="no in-process pool"):
        prefill.submit(Prefill("ghost", prompt, params, destination=ghost), ListSink())
    first = prefill_into(prefill, prompt, params, "ok", reserved).replies[0]
    assert isinstance(first, Prefilled) and first.kv_bytes > 0
    decode.release(Release("ok", reserved.lease, writer_closed=True))


def test_an_abort_stops_the_prefill_pass_at_the_next_layer(default_engine, pair):
    """A prefill aborted mid-pass computes no further layer: its request ends CANCELLED long before the
    pass could have ended (a writer slowed to 0.1 s a layer makes a whole pass take 30 x 0.1 = 3 s)."""
    prefill, decode = pair
    prefill.write_delay_s = 0.1
    params = SamplingParams(max_tokens=4)
    ids = default_engine.tokenizer.encode("Tell me about the history of the Roman empire in detail.")
    reserved, dsink = reserve(decode, ids, params, "left")
    psink = ListSink()
    t0 = time.monotonic()
    prefill.submit(Prefill("left", ids, params, destination=reserved.destination), psink)
    time.sleep(0.25)  # a few layers in
    assert prefill.abort("left").found
    assert psink.finished.wait(30)
    took = time.monotonic() - t0
    assert isinstance(psink.error, Cancelled)
    assert took < 2.0, f"the aborted pass ran on for {took:.1f}s (a whole pass is at least 3 s)"
    decode.release(Release("left", reserved.lease, writer_closed=True))
    assert dsink.finished.wait(5)
    assert wait_until(lambda: decode.stats().pages_used == 0)


class BehindBlocker:
    """Prompts reserved at the decode worker and queued at the prefill worker behind a "blocker" prompt,
    which is then aborted, so that they share the prefill worker's next group. Writers are slowed to 0.1 s
    a layer (a pass takes about 3 s)."""

    def __init__(self, prefill, decode, prompts: dict[str, list[int]], params: SamplingParams, order: list[str]):
        self.prefill, self.decode, self.prompts, self.params = prefill, decode, prompts, params
        prefill.write_delay_s = 0.1
        self.leases = {rid: reserve(decode, ids, params, rid) for rid, ids in prompts.items()}
        self.sinks = {rid: ListSink() for rid in prompts}
        self._submit("blocker")
        time.sleep(0.15)  # its pass runs; the others queue behind it and share the next group
        for rid in order:
            self._submit(rid)
        prefill.abort("blocker")

    def _submit(self, rid: str) -> None:
        self.prefill.submit(Prefill(rid, self.prompts[rid], self.params, destination=self.leases[rid][0].destination),
                            self.sinks[rid])

    def check_answer(self, engine, rid: str) -> None:
        """`rid`'s first token and the decode worker's rest are exactly an undisturbed run's; the other
        requests were cancelled and their leases are given back."""
        assert self.sinks[rid].finished.wait(60)
        first = self.sinks[rid].replies[0]
        assert isinstance(first, Prefilled), self.sinks[rid].error
        reserved, dsink = self.leases[rid]
        self.decode.start(Start(rid, reserved.lease, first.token, first.logprob))
        assert dsink.finished.wait(60)
        assert [first.token] + dsink.tokens == complete(engine, self.prompts[rid], self.params).output_ids
        for other in self.prompts.keys() - {rid}:
            assert isinstance(self.sinks[other].error, Cancelled)
            self.decode.release(Release(other, self.leases[other][0].lease, writer_closed=True))


def test_a_pass_mostly_for_requests_that_left_is_given_up_and_the_rest_redone(default_engine, pair):
    """Two prompts share a pass; the longer one is aborted mid-pass. The pass stops at the next layer
    (the aborted one ends at once), and the other is computed again on its own: exact first token,
    exact answer. (The shared pass alone would take 6 s.)"""
    prefill, decode = pair
    tok = default_engine.tokenizer
    prompts = {"blocker": tok.encode("Hello there."), "leave": tok.encode(
        "Tell me about the history of the Roman empire in detail, from its founding to its fall."),
        "stay": tok.encode("Name a color.")}
    group = BehindBlocker(prefill, decode, prompts, SamplingParams(max_tokens=6), ["leave", "stay"])
    time.sleep(0.5)  # a few layers into the shared pass
    t0 = time.monotonic()
    prefill.abort("leave")
    assert group.sinks["leave"].finished.wait(30)
    took = time.monotonic() - t0
    assert took < 3.0, f"the aborted request waited {took:.1f}s for its pass (the pass alone takes 6 s)"
    group.check_answer(default_engine, "stay")


def test_the_fence_keeps_a_late_writer_out_of_pages_given_to_another_request(default_engine, pair):
    """A slowed writer is still writing when its lease is released; its pages go at once to a new
    request, which a second prefill worker fills and the decode worker runs while the late writer is
    still computing layers meant for those pages. The fence refuses every late layer: the new output is
    exact (without the fence, the late layers overwrite the new request's K/V and it is not)."""
    prefill, decode = pair
    fast = PrefillWorker(prefill.engine, registry=prefill.registry).launch()
    prefill.write_delay_s = 0.1  # 30 layers: the late writer keeps trying for 3 s
    params = SamplingParams(max_tokens=12)
    old = default_engine.tokenizer.encode("Tell me about the history of the Roman empire in detail.")
    new = default_engine.tokenizer.encode("The capital of France is")
    reserved_old, old_sink = reserve(decode, old, params, "old")
    late = ListSink()
    prefill.submit(Prefill("old", old, params, destination=reserved_old.destination), late)
    time.sleep(0.25)  # a few layers in
    decode.release(Release("old", reserved_old.lease))  # no writer_closed: the fence must do it
    assert old_sink.finished.wait(5) and isinstance(old_sink.error, Cancelled)
    assert wait_until(lambda: decode.stats().pages_used == 0 and decode.stats().pages_fenced == 0, 2)
    alloc = decode.engine.allocator
    with decode.lock:  # leave only the old request's pages free, so the new one must get them
        filler = alloc.allocate(alloc.num_pages - alloc.num_used - len(reserved_old.destination.page_ids))
    try:
        reserved_new, new_sink = reserve(decode, new, params, "new")
        assert set(reserved_new.destination.page_ids) & set(reserved_old.destination.page_ids), \
            "the test needs the new request to get the old one's pages"
        first = prefill_into(fast, new, params, "new", reserved_new).replies[0]
        assert first.finish_reason is None and not late.finished.is_set()  # the late writer is still at it
        decode.start(Start("new", reserved_new.lease, first.token))
        assert late.finished.wait(30)
        assert status_of(late.error) is Status.LEASE_LOST  # its remaining layers were refused
        assert new_sink.finished.wait(60)
        assert [first.token] + new_sink.tokens == complete(default_engine, new, params).output_ids
    finally:
        fast.close()
        with decode.lock:
            alloc.free(filler)


def test_long_prompts_are_prefilled_in_chunks_and_short_ones_slip_in_between(default_engine, pair):
    prefill, decode = pair
    prefill.loop.stop()  # drive passes by hand to see their order
    prefill.pass_tokens, prefill.chunk_tokens = 64, 64
    prefill.engine.attach_pool(prefill.layout.pages_for(1024))
    params = SamplingParams(max_tokens=10)
    long_ids = default_engine.tokenizer.encode_chat([ChatMessage("user", "Summarize: " + "the cat sat on the mat. " * 40)])
    short_ids = default_engine.tokenizer.encode("Hello there")
    assert len(long_ids) > 3 * 64
    order, reservations = [], {}
    for rid, ids in (("long", long_ids), ("short", short_ids)):
        reserved, dsink = reserve(decode, ids, params, rid)
        psink = ListSink()
        psink.send = lambda body, final=False, rid=rid, s=psink: (order.append(rid), ListSink.send(s, body, final))
        prefill.submit(Prefill(rid, ids, params, destination=reserved.destination), psink)
        reservations[rid] = (reserved, dsink, psink, ids)
    while prefill.step():
        pass
    assert order == ["short", "long"]
    assert prefill.engine.allocator.num_used == 0  # the local pool is given back
    for rid, (reserved, dsink, psink, ids) in reservations.items():
        first = psink.replies[0]
        decode.start(Start(rid, reserved.lease, first.token))
        assert dsink.finished.wait(60)
        assert [first.token] + dsink.tokens == complete(default_engine, ids, params).output_ids, rid


def test_a_colocated_worker_prefills_locally_and_refuses_remote_writers(default_engine):
    engine = Engine(default_engine.model, default_engine.tokenizer, KVCache(default_engine.cache.layout, 128))
    worker = DecodeWorker(engine, None, role="generate", chunk_tokens=None).launch()
    try:
        ids = default_engine.tokenizer.encode("The capital of France is")
        params = SamplingParams(max_tokens=8)
        with pytest.raises(ProtocolError, match="prefills every request itself"):
            worker.open(Open("r", ids, params), ListSink())
        sink = ListSink()
        worker.open(Open("r", ids, params, local_prefill=True), sink)
        assert sink.finished.wait(60)
        assert sink.tokens == complete(default_engine, ids, params).output_ids
        assert wait_until(lambda: engine.allocator.num_used == 0)
    finally:
        worker.close()


def test_the_shm_sender_refuses_a_destination_it_cannot_reach(default_engine, pair):
    _, decode = pair
    reserved, _ = reserve(decode, [1, 2, 3], SamplingParams(max_tokens=2), "y")
    s = sender("shm", default_engine.kv_layout())
    try:
        with pytest.raises(TransferFailed, match="offers \\['inproc'\\], not 'shm'"):
            s.writer(reserved.destination, "y")
    finally:
        s.close()
        decode.release(Release("y", reserved.lease, writer_closed=True))


def test_pages_that_arrived_wait_for_room_past_the_transfer_timeout(default_engine):
    """The decode worker takes a Start before it has polled the writer's "done" notice (its loop was busy
    in a step): the transfer deadline is armed. The notice comes, but the batch is full (one sequence at
    most, decoding for seconds), so the request waits for room well past the transfer timeout; it must
    not fail with TRANSFER_FAILED, and it decodes exactly once the batch has room."""
    params = SamplingParams(max_tokens=6)
    long = SamplingParams(max_tokens=160, ignore_eos=True)
    with worker_pair(default_engine, max_batch_size=1, transfer_timeout_s=0.5) as (prefill, decode):
        busy = default_engine.tokenizer.encode("Write a long story about a dragon.")
        reserved, busy_sink = reserve(decode, busy, long, "busy")
        first = prefill_into(prefill, busy, long, "busy", reserved).replies[0]
        decode.start(Start("busy", reserved.lease, first.token, first.logprob))
        ids = default_engine.tokenizer.encode("Name a color.")
        want = complete(default_engine, ids, params).output_ids
        reserved, sink = reserve(decode, ids, params, "waits")
        decode.start(Start("waits", reserved.lease, want[0], None))  # taken before the notice is polled
        assert isinstance(prefill_into(prefill, ids, params, "waits", reserved).replies[0], Prefilled)
        assert not busy_sink.finished.wait(1.0)  # the batch stays full past the 0.5 s transfer timeout
        assert sink.finished.wait(60) and busy_sink.finished.wait(60)
        assert sink.error is None and [want[0]] + sink.tokens == want


def test_a_writer_notice_for_a_lease_released_before_start_is_not_kept(default_engine, pair):
    """The writer's "done" notice reached the decode worker while the lease was still reserved (kept for
    its Start), then the request ended without a Start (its first token ended it, or its caller left):
    the decode worker keeps nothing of it."""
    prefill, decode = pair
    params = SamplingParams(max_tokens=4)
    ids = default_engine.tokenizer.encode("Name a color.")
    reserved, dsink = reserve(decode, ids, params, "r")
    assert isinstance(prefill_into(prefill, ids, params, "r", reserved).replies[0], Prefilled)
    assert wait_until(lambda: "r" in decode.arrived)  # the notice, polled before any Start
    decode.release(Release("r", reserved.lease, writer_closed=True))
    assert dsink.finished.wait(10) and wait_until(lambda: not decode.arrived)
