"""A prefill worker with a pool of its own runs a group of prompts as two passes: those it had room for
against their pages, then the others straight into their writers. When the second pass is given up (most
of its work left), the first one's prompts are answered with the token they computed, not computed again
(which would answer the token after it)."""

from __future__ import annotations

import time

import pytest

from engine.engine import Engine
from engine.kv_pool import KVCache
from engine.transports.host import PoolHost
from engine.workers.decode_worker import DecodeWorker
from engine.workers.prefill_worker import PrefillWorker
from tandem.sampling_params import SamplingParams
from tandem.status import Cancelled
from tandem.wire import Prefill, Prefilled, Release, Start
from tests.conftest import complete
from tests.workers.test_handoff import ListSink, reserve, wait_until


@pytest.fixture
def pooled_pair(default_engine):
    """A prefill worker whose own pool has 2 pages (16 tokens each) and a decode worker (inproc pool)."""
    registry: dict = {}
    layout = default_engine.cache.layout
    decode_engine = Engine(default_engine.model, default_engine.tokenizer, KVCache(layout, 256))
    host = PoolHost(decode_engine.cache, ("inproc",), registry)
    decode = DecodeWorker(decode_engine, host, transfer_timeout_s=5.0).launch()
    prefill_engine = Engine(default_engine.model, default_engine.tokenizer, KVCache(layout, 2))
    prefill = PrefillWorker(prefill_engine, registry=registry).launch()
    yield prefill, decode
    assert wait_until(lambda: not decode.inbox), "the decode loop never applied its last notices"
    prefill.close()
    decode.close()
    host.close()
    assert decode_engine.allocator.num_used == 0, "a test leaked decode pages"


def test_a_pooled_prompt_keeps_its_token_when_the_direct_pass_after_it_is_given_up(default_engine, pooled_pair):
    """"stay" (one page) gets the pool's room, "leave" (two pages) does not: they share a group, "stay"
    against its pages first, then "leave" into its writer. "leave" is aborted during its own pass, which
    is then given up; "stay" computed its first token in the pass before and is answered with it, exactly.
    (Writers slowed to 0.1 s a layer: each pass takes about 3 s.)"""
    prefill, decode = pooled_pair
    tpp = default_engine.tokens_per_page
    prefill.write_delay_s = 0.1
    params = SamplingParams(max_tokens=6)
    tok = default_engine.tokenizer
    prompts = {"blocker": tok.encode("Hello there."), "stay": tok.encode("One, two, three,"), "leave": tok.encode(
        "Tell me about the history of the Roman empire in detail, from its founding to its fall.")}
    assert len(prompts["stay"]) <= tpp < len(prompts["leave"]) <= 2 * tpp
    leases = {rid: reserve(decode, ids, params, rid) for rid, ids in prompts.items()}
    sinks = {rid: ListSink() for rid in prompts}

    def submit(rid):
        prefill.submit(Prefill(rid, prompts[rid], params, destination=leases[rid][0].destination), sinks[rid])

    submit("blocker")
    time.sleep(0.15)  # its pass runs; the next two queue behind it and share the next group
    submit("stay")
    submit("leave")
    prefill.abort("blocker")
    time.sleep(4.5)  # "stay"'s pass (~3 s from about 0.2 s) is done; "leave"'s is a few layers in
    prefill.abort("leave")
    assert sinks["leave"].finished.wait(30) and sinks["stay"].finished.wait(60)
    assert isinstance(sinks["leave"].error, Cancelled) and isinstance(sinks["blocker"].error, Cancelled)
    first = sinks["stay"].replies[0]
    assert isinstance(first, Prefilled), sinks["stay"].error
    (_, dsink) = leases["stay"]
    decode.start(Start("stay", leases["stay"][0].lease, first.token, first.logprob))
    assert dsink.finished.wait(60)
    assert [first.token] + dsink.tokens == complete(default_engine, prompts["stay"], params).output_ids
    for rid in ("blocker", "leave"):
        decode.release(Release(rid, leases[rid][0].lease, writer_closed=True))
