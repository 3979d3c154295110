"""The handoff protocol as a state machine: prefill worker -> pages -> decode worker, every exit frees pages."""

from __future__ import annotations

import threading
import time

import pytest

from engine.engine import Engine
from engine.errors import InvalidRequest, OutOfPages
from engine.kv_pool import KVCache
from engine.sampling import SamplingParams
from engine.tokenizer import ChatMessage
from engine.transports import endpoint, sender
from engine.workers.decode import DecodeWorker
from engine.workers.prefill import PrefillWorker
from tandem.wire import DecodeOp, Destination, PrefillRequest
from tests.conftest import complete

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Count from one to five.",
           "Name a color."]


class ListSink:
    def __init__(self):
        self.tokens, self.reason, self.error, self.gone = [], None, None, False
        self.done = threading.Event()

    def send(self, token, logprob, finish_reason):
        self.tokens.append(token)
        if finish_reason:
            self.reason = finish_reason
            self.done.set()

    def finish(self, reason):
        self.reason = reason
        self.done.set()

    def fail(self, message):
        self.error = message
        self.done.set()

    def cancelled(self):
        return self.gone


@pytest.fixture
def pair(default_engine):
    """A prefill worker (no pool) and a decode worker with its own pool, sharing the model weights."""
    registry: dict = {}
    decode_engine = Engine(default_engine.model, default_engine.tokenizer,
                           KVCache(default_engine.cache.layout, 256))
    ep = endpoint("inproc", decode_engine.cache, registry)
    decode = DecodeWorker(decode_engine, ep, lease_s=5.0, transfer_timeout_s=5.0)
    prefill = PrefillWorker(Engine(default_engine.model, default_engine.tokenizer, None))
    prefill.senders["inproc"] = sender("inproc", decode_engine.cache.layout, registry)
    yield prefill, decode
    prefill.close()
    ep.close()
    assert decode_engine.allocator.num_used == 0, "a test leaked decode pages"


def run_loop(decode: DecodeWorker, sinks, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not all(s.done.is_set() for s in sinks) and time.monotonic() < deadline:
        decode.step()


def handoff(prefill, decode, prompt_ids, params, rid):
    res = decode.reserve(DecodeOp(op="reserve", request_id=rid, num_tokens=len(prompt_ids),
                                  max_tokens=params.max_tokens))
    req = PrefillRequest(rid, params.to_dict(), Destination(res.pool, res.page_ids, res.lease))
    return res, req


def test_disaggregated_greedy_equals_single_engine(default_engine, pair):
    prefill, decode = pair
    params = SamplingParams(max_tokens=16)
    prompts = [default_engine.tokenizer.encode_chat([ChatMessage("user", p)]) for p in PROMPTS]
    expected = [complete(default_engine, p, params).output_ids for p in prompts]
    reservations = [handoff(prefill, decode, p, params, f"r{i}") for i, p in enumerate(prompts)]
    results = prefill.prefill_all([(p, req) for p, (_, req) in zip(prompts, reservations)])
    sinks = []
    for p, (res, req), out in zip(prompts, reservations, results):
        sink = ListSink()
        decode.generate(DecodeOp(op="generate", request_id=req.request_id, lease=res.lease, prompt_ids=p,
                                 output_ids=[out.token], sampling=params.to_dict()), sink)
        sinks.append((out.token, sink))
    run_loop(decode, [s for _, s in sinks])
    for (first, sink), want in zip(sinks, expected):
        assert [first] + sink.tokens == want and sink.reason in ("stop", "length")
    assert decode.stats().pages_used == 0


def test_lease_expires_by_itself(pair):
    _, decode = pair
    decode.reserve(DecodeOp(op="reserve", request_id="lost", num_tokens=40, max_tokens=8, lease_ms=50))
    assert decode.stats().leased == 1 and decode.stats().pages_used > 0
    time.sleep(0.1)
    decode.step()
    assert decode.stats().pages_used == 0 and decode.stats().leased == 0


def test_pages_that_never_arrive_time_out(pair):
    _, decode = pair
    decode.transfer_timeout_s = 0.1
    res = decode.reserve(DecodeOp(op="reserve", request_id="x", num_tokens=3, max_tokens=4))
    sink = ListSink()
    decode.generate(DecodeOp(op="generate", request_id="x", lease=res.lease, prompt_ids=[1, 2, 3], output_ids=[5],
                             sampling=SamplingParams(max_tokens=4).to_dict()), sink)
    time.sleep(0.15)
    decode.step()
    assert "transfer timed out" in sink.error and decode.stats().pages_used == 0


def test_release_and_cancel_stop_a_running_stream(default_engine, pair):
    prefill, decode = pair
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompt = default_engine.tokenizer.encode("Once upon a time")
    sinks = []
    for rid in ("rel", "can"):
        res, req = handoff(prefill, decode, prompt, params, rid)
        out = prefill.prefill_all([(prompt, req)])[0]
        sink = ListSink()
        decode.generate(DecodeOp(op="generate", request_id=rid, lease=res.lease, prompt_ids=prompt,
                                 output_ids=[out.token], sampling=params.to_dict()), sink)
        sinks.append((res, sink))
    for _ in range(3):
        decode.step()
    assert decode.stats().running == 2
    decode.release(DecodeOp(op="release", request_id="rel", lease=sinks[0][0].lease))
    sinks[1][1].gone = True
    decode.step()
    assert sinks[0][1].reason == "abort" and 0 < len(sinks[0][1].tokens) < 10
    assert decode.stats().pages_used == 0 and decode.stats().running == 0


def test_bad_calls_are_refused_and_change_nothing_else(default_engine, pair):
    _, decode = pair
    good = decode.reserve(DecodeOp(op="reserve", request_id="good", num_tokens=10, max_tokens=5))
    before = decode.stats()
    ops = [
        (DecodeOp(op="generate", request_id="nobody", lease="x", prompt_ids=[1], output_ids=[2]), "unknown request id"),
        (DecodeOp(op="generate", request_id="good", lease="stolen", prompt_ids=[1] * 10, output_ids=[2]),
         "leased to someone else"),
        (DecodeOp(op="release", request_id="good", lease="stolen"), "leased to someone else"),
        (DecodeOp(op="generate", request_id="good", lease=good.lease, prompt_ids=[1] * 3, output_ids=[2]),
         "reserved pages for 10 tokens"),
        (DecodeOp(op="generate", request_id="good", lease=good.lease, prompt_ids=[1] * 10, output_ids=[]),
         "needs output_ids"),
        (DecodeOp(op="reserve", request_id="good", num_tokens=1, max_tokens=1), "already holds a reservation"),
        (DecodeOp(op="reserve", request_id="zero", num_tokens=0, max_tokens=1), "num_tokens >= 1"),
    ]
    for op, message in ops:
        with pytest.raises(InvalidRequest, match=message):
            (decode.reserve if op.op == "reserve" else decode.release if op.op == "release"
             else lambda o: decode.generate(o, ListSink()))(op)
    assert decode.stats() == before
    with pytest.raises(OutOfPages):
        decode.reserve(DecodeOp(op="reserve", request_id="huge", num_tokens=5000, max_tokens=3000))
    assert decode.stats() == before
    decode.release(DecodeOp(op="release", request_id="good", lease=good.lease))


def test_prefill_batch_with_bad_members_still_serves_the_good_ones(default_engine, pair):
    prefill, decode = pair
    params = SamplingParams(max_tokens=4)
    prompt = default_engine.tokenizer.encode("Hello there")
    res, req = handoff(prefill, decode, prompt, params, "ok")
    bad_pool = PrefillRequest("badpool", params.to_dict(),
                              Destination({"transport": "inproc", "id": "gone", "num_pages": 9,
                                           "layout": res.pool["layout"]}, [1], "l"))
    bad_params = PrefillRequest("badparams", {"top_p": 7.0})
    out = prefill.prefill_all([(prompt, req), ([], PrefillRequest("empty", params.to_dict())), (prompt, bad_pool),
                       (prompt, bad_params)])
    assert out[0].token >= 0 and out[0].kv_bytes > 0
    assert "prompt is empty" in str(out[1])
    assert "no in-process pool" in str(out[2])
    assert "top_p must be in (0, 1]" in str(out[3])
    decode.release(DecodeOp(op="release", request_id="ok", lease=res.lease))


def test_long_prompts_are_prefilled_in_chunks_and_short_ones_slip_in_between(default_engine, pair):
    """A prompt longer than a pass is prefilled chunk by chunk (its pages streaming to the decode
    worker); a short prompt submitted behind it is answered before the long one, and both decode
    exactly as in a single engine."""
    prefill, decode = pair
    prefill.pass_tokens, prefill.chunk_tokens = 64, 64
    prefill.engine.attach_pool(prefill.layout.pages_for(1024))
    params = SamplingParams(max_tokens=10)
    long_ids = default_engine.tokenizer.encode_chat([ChatMessage("user", "Summarize: " + "the cat sat on the mat. " * 40)])
    short_ids = default_engine.tokenizer.encode("Hello there")
    assert len(long_ids) > 3 * 64
    answered = []
    reservations = {}
    for rid, ids in (("long", long_ids), ("short", short_ids)):
        res, req = handoff(prefill, decode, ids, params, rid)
        reservations[rid] = (res, ids)
        prefill.submit(ids, req, lambda r, rid=rid: answered.append((rid, r)))
    while prefill.step():
        pass
    assert [rid for rid, _ in answered] == ["short", "long"]
    assert prefill.engine.allocator.num_used == 0  # the local pool is given back
    sinks = {}
    for rid, result in answered:
        res, ids = reservations[rid]
        sinks[rid] = (result.token, ListSink())
        decode.generate(DecodeOp(op="generate", request_id=rid, lease=res.lease, prompt_ids=ids,
                                 output_ids=[result.token], sampling=params.to_dict()), sinks[rid][1])
    run_loop(decode, [s for _, s in sinks.values()])
    for rid, ids in (("long", long_ids), ("short", short_ids)):
        first, sink = sinks[rid]
        assert [first] + sink.tokens == complete(default_engine, ids, params).output_ids, rid
