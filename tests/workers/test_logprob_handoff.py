"""Logprob reports and the repetition penalty across the handoff (workers in one process, real model):
the prefill worker's Prefilled and the decode worker's Tokens carry, bit for bit, what one engine computes alone."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.kv_pool import KVCache
from engine.workers.decode_worker import DecodeWorker
from tandem.sampling_params import SamplingParams
from tandem.wire import Open, Prefill, Start, Token
from tests.conftest import complete
from tests.workers.test_handoff import ListSink, pair, reserve, wait_until  # noqa: F401 (pair: a fixture)

PARAMS = SamplingParams(max_tokens=8, temperature=0.8, seed=11, repetition_penalty=1.3, logprobs=True,
                        top_logprobs=2, prompt_logprobs=True)


def _lps(reports):
    return [r.logprob for r in reports]


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_and_penalized_samples_cross_the_handoff(default_engine, pair, chunk):  # noqa: F811
    prefill, decode = pair
    if chunk:  # the prompt is computed in chunks into the prefill worker's own pool
        prefill.pass_tokens, prefill.chunk_tokens = chunk, chunk
        prefill.engine.attach_pool(prefill.layout.pages_for(512))
    ids = default_engine.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    want = complete(default_engine, ids, PARAMS)
    reserved, dsink = reserve(decode, ids, PARAMS, "r")
    psink = ListSink()
    prefill.submit(Prefill("r", ids, PARAMS, destination=reserved.destination), psink)
    assert psink.finished.wait(60)
    first = psink.replies[0]
    assert _lps(first.prompt_logprobs) == _lps(want.prompt_logprobs)  # bit for bit: one arithmetic on every path
    assert len(first.top.top_ids) == 2
    decode.start(Start("r", reserved.lease, first.token, first.logprob))
    assert dsink.finished.wait(60)
    tokens = [r for r in dsink.replies if isinstance(r, Token) and r.token is not None]
    assert [first.token] + [t.token for t in tokens] == want.output_ids  # the penalty read the same history
    assert [first.logprob] + [t.logprob for t in tokens] == want.output_logprobs
    assert all(len(t.top.top_ids) == 2 and not t.prompt_logprobs for t in tokens)
    if chunk:
        assert prefill.engine.allocator.num_used == 0


def test_a_colocated_worker_sends_the_prompt_logprobs_with_the_first_token(default_engine):
    engine = Engine(default_engine.model, default_engine.tokenizer, KVCache(default_engine.cache.layout, 128))
    worker = DecodeWorker(engine, None, role="generate", chunk_tokens=None).launch()
    try:
        ids = default_engine.tokenizer.encode("Once upon a time")
        sink = ListSink()
        worker.open(Open("r", ids, PARAMS, local_prefill=True), sink)
        assert sink.finished.wait(60)
        tokens = [r for r in sink.replies if isinstance(r, Token)]
        want = complete(default_engine, ids, PARAMS)
        assert [t.token for t in tokens] == want.output_ids
        assert _lps(tokens[0].prompt_logprobs) == _lps(want.prompt_logprobs)
        assert all(not t.prompt_logprobs for t in tokens[1:])
        assert wait_until(lambda: engine.allocator.num_used == 0)
    finally:
        worker.close()
