"""Prefill and decode in two real Triton instances, KV pages handed over by shm and by NIXL."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
from tritonclient.grpc import InferInput

from builder.repo import RepoOptions
from engine.generate import run_generation
from engine.sampling import SamplingParams
from engine.tokenizer import ChatMessage
from engine.transports.nixl import available as nixl_available
from orchestrator.handoff import HandoffError, handoff
from orchestrator.worker_client import DecodeClient, PrefillClient, WorkerError
from orchestrator.workers import WorkerSet
from tandem.wire import DecodeOp, Destination, PrefillRequest
from tests.conftest import leak_check, leak_snapshot

LONG = " ".join(f"Item {i}: a lantern, a map and a compass were packed for the trip." for i in range(25))
PROMPTS = ["Hi", "What is the capital of France?", "Write two sentences about the moon.",
           "Give me three words that rhyme with cat.", f"Summarize this list in one sentence: {LONG}"]
TRANSPORTS = ["shm", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="NIXL not installed"))]


@pytest.fixture(scope="module", params=TRANSPORTS)
def workers(request, built_engines, tmp_path_factory):
    before = leak_snapshot()
    ws = WorkerSet(str(built_engines), str(tmp_path_factory.mktemp(f"workers-{request.param}")),
                   {"prefill": 1, "decode": 1}, RepoOptions(transport=request.param, kv_pool_bytes=128 << 20))
    ws.start()
    yield ws
    ws.stop()
    assert leak_check(before) == []


def clients(ws):
    return PrefillClient(ws.urls("prefill")[0]), DecodeClient(ws.urls("decode")[0])


async def collect(p, d, rid, ids, params, **kw):
    out = []
    async with contextlib.aclosing(handoff(p, d, rid, ids, params, **kw)) as stream:
        async for t in stream:
            if t.token is not None:
                out.append(t.token)
    return out


def test_greedy_through_two_tritons_equals_single_process(workers, default_engine):
    params = SamplingParams(max_tokens=20)
    prompts = [default_engine.tokenizer.encode_chat([ChatMessage("user", p)]) for p in PROMPTS]
    assert len(prompts[-1]) > 300
    expected = [run_generation(default_engine, ids, params).token_ids for ids in prompts]

    async def run():
        p, d = clients(workers)
        try:
            got = await asyncio.gather(*[collect(p, d, f"req-{i}", ids, params) for i, ids in enumerate(prompts)])
            return got, await d.stats()
        finally:
            await p.close()
            await d.close()

    got, stats = asyncio.run(run())
    assert got == expected
    assert stats.pages_used == 0 and stats.leased == 0 and stats.running == 0
    assert stats.kv_bytes_received == sum(len(ids) for ids in prompts) * default_engine.kv_layout().bytes_per_token


def test_a_reservation_never_committed_expires_by_itself(workers):
    async def run():
        _, d = clients(workers)
        try:
            await d.reserve(DecodeOp(op="reserve", request_id="abandoned", num_tokens=100, max_tokens=50,
                                     lease_ms=300))
            held = (await d.stats()).pages_used
            await asyncio.sleep(0.8)
            return held, (await d.stats()).pages_used
        finally:
            await d.close()

    held, after = asyncio.run(run())
    assert held == 10 and after == 0  # 150 tokens / 16 per page


def _raw(name, arr, dtype):
    t = InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def test_bad_input_gets_a_clear_error_and_changes_no_other_request(workers, default_engine):
    ids = default_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    params = SamplingParams(max_tokens=6)

    async def run():
        p, d = clients(workers)
        errors = {}
        try:
            good = await d.reserve(DecodeOp(op="reserve", request_id="good", num_tokens=len(ids), max_tokens=6))
            before = await d.stats()

            async def expect(name, coro):
                try:
                    await coro
                except (WorkerError, Exception) as e:  # tritonclient raises its own exception type for dtype errors
                    errors[name] = str(e)

            await expect("wrong dtype", p.call([
                _raw("input_ids", np.array([ids], dtype=np.float32), "FP32"),
                _raw("request", np.array([[b"{}"]], dtype=np.object_), "BYTES")], "w1"))
            await expect("wrong shape", p.call([
                _raw("input_ids", np.array([ids], dtype=np.int32), "INT32"),
                _raw("request", np.array([[b"{}", b"{}"]], dtype=np.object_), "BYTES")], "w2"))
            await expect("not json", p.call([
                _raw("input_ids", np.array([ids], dtype=np.int32), "INT32"),
                _raw("request", np.array([[b"{oops"]], dtype=np.object_), "BYTES")], "w3"))
            await expect("unknown request", d.op(DecodeOp(op="generate", request_id="nobody", lease="x",
                                                          prompt_ids=ids, output_ids=[1])))
            await expect("not your pages", d.release("good", "stolen-lease"))
            await expect("no such pool", p.prefill(ids, PrefillRequest(
                "ghost", params.to_dict(), Destination(dict(good.pool, segment="tandem-kv-1-dead", agent="decode-x",
                                                            metadata="bm9wZQ=="), good.page_ids, good.lease))))
            await expect("unknown op", d.op(DecodeOp(op="explode")))
            after = await d.stats()
            # the good request is untouched and still completes
            first = await p.prefill(ids, PrefillRequest("good", params.to_dict(),
                                                        Destination(good.pool, good.page_ids, good.lease)))
            rest = [t async for t in d.generate(DecodeOp(op="generate", request_id="good", lease=good.lease,
                                                         prompt_ids=ids, output_ids=[first.token],
                                                         sampling=params.to_dict()))]
            return errors, before, after, [first.token] + [t for t, _, _ in rest if t is not None], await d.stats()
        finally:
            await p.close()
            await d.close()

    errors, before, after, tokens, final = asyncio.run(run())
    assert "FP32" in errors["wrong dtype"] and "INT32" in errors["wrong dtype"]
    assert "one element" in errors["wrong shape"] or "shape" in errors["wrong shape"]
    assert "not valid JSON" in errors["not json"]
    assert "unknown request id 'nobody'" in errors["unknown request"]
    assert "leased to someone else" in errors["not your pages"]
    assert "cannot map decode pool" in errors["no such pool"] or "cannot connect" in errors["no such pool"]
    assert "unknown op 'explode'" in errors["unknown op"]
    assert before == after
    assert tokens == run_generation(default_engine, ids, params).token_ids
    assert final.pages_used == 0


def test_a_failed_prefill_releases_the_reservation(workers):
    async def run():
        p, d = clients(workers)
        try:
            with pytest.raises(HandoffError, match="prefill failed") as e:
                await collect(p, d, "bad-prompt", [10**6], SamplingParams(max_tokens=4))
            assert e.value.error.kind == "invalid_argument"
            return await d.stats()
        finally:
            await p.close()
            await d.close()

    assert asyncio.run(run()).pages_used == 0
