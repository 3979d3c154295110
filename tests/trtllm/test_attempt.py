"""TrtllmAttempt's exits, one by one, against stand-in worker clients that record what they are sent.

Stand-ins because these exits (a pull failing before or after the first decode token, a cancel landing
in the middle of a context request) cannot be placed exactly through real workers; the same attempt
runs against real Triton workers through `tandem serve` in tests/trtllm/test_stack.py."""

from __future__ import annotations

import asyncio

import pytest

from control.fleet import WorkerState
from control.handoff import Timings
from control.trtllm_attempt import TrtllmAttempt
from tandem.guides import Guide, GuideKind
from tandem.sampling_params import SamplingParams
from tandem.status import InvalidArgument, Status, TandemError, TransferFailed, Unavailable, status_of
from tandem.trtllm_wire import TrtllmDecode, TrtllmParams, TrtllmPrefilled
from tandem.wire import Prefill, Token

PARAMS = TrtllmParams(first_gen_tokens=[7], ctx_request_id=1, opaque_state=b"ctx")


class PrefillStandIn:
    def __init__(self, answer):
        self.answer, self.sent, self.aborted = answer, [], []

    async def prefill_trtllm(self, msg: Prefill):
        self.sent.append(msg)
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "hang":
            await asyncio.Event().wait()
        return self.answer

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class DecodeStandIn:
    def __init__(self, script):
        self.script, self.sent, self.aborted = script, [], []

    def decode_trtllm(self, msg: TrtllmDecode):
        self.sent.append(msg)

        async def stream():
            for item in self.script:
                if isinstance(item, BaseException):
                    raise item
                yield item
        return stream()

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def prefilled(token=7, reason=None, params=PARAMS):
    return TrtllmPrefilled("r", token, -0.5, reason, None if reason else params, compute_seconds=0.01)


def attempt(prefill_answer, decode_script, sent=(), max_tokens=4):
    p = WorkerState("prefill-0", "prefill", "p:1", PrefillStandIn(prefill_answer))
    d = WorkerState("decode-0", "decode", "d:1", DecodeStandIn(decode_script))
    a = TrtllmAttempt(d, p, "r", [1, 2, 3], SamplingParams(max_tokens=max_tokens), list(sent), Timings())
    return a, p.client, d.client


async def drain(a: TrtllmAttempt) -> list[Token]:
    out = []
    async with a:
        while (t := await a.next()) is not None:
            out.append(t)
    return out


def test_done_sends_the_params_to_decode_and_aborts_nothing():
    a, p, d = attempt(prefilled(), [Token(8, None, None), Token(9, None, "length")], sent=[5])
    calls = []
    a.on_first, a.on_pulled = lambda: calls.append("first"), lambda: calls.append("pulled")
    toks = asyncio.run(drain(a))
    assert [(t.token, t.finish_reason) for t in toks] == [(7, None), (8, None), (9, "length")]
    assert p.sent[0].destination is None and p.sent[0].output_ids == [5]
    msg = d.sent[0]
    assert msg.prompt_ids == [1, 2, 3, 5] and msg.params == PARAMS and msg.sampling.max_tokens == 3
    assert calls == ["first", "pulled"] and a.timings.transport == "trtllm"
    assert a.timings.first_token <= a.timings.pulled_at
    assert p.aborted == [] and d.aborted == []


def test_a_first_token_that_ends_the_request_involves_no_decode_worker():
    a, p, d = attempt(prefilled(reason="stop"), [])
    toks = asyncio.run(drain(a))
    assert [(t.token, t.finish_reason) for t in toks] == [(7, "stop")]
    assert d.sent == [] and p.aborted == [] and d.aborted == []


def test_a_failed_prefill_is_the_prefill_workers():
    a, p, d = attempt(Unavailable("gone"), [])
    with pytest.raises(Unavailable) as e:
        asyncio.run(drain(a))
    assert e.value.worker.name == "prefill-0" and d.sent == []


def test_a_prefill_without_params_is_refused():
    a, p, d = attempt(TrtllmPrefilled("r", 7, None, None, None, compute_seconds=0.0), [])
    with pytest.raises(Unavailable, match="no disaggregated params") as e:
        asyncio.run(drain(a))
    assert e.value.worker.name == "prefill-0" and d.sent == []


def test_a_cancel_during_the_context_request_aborts_it():
    a, p, d = attempt("hang", [])

    async def run():
        task = asyncio.create_task(drain(a))
        while not p.sent:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(run())
    assert p.aborted == ["r"] and d.sent == []


def test_a_pull_that_fails_before_any_decode_token_is_blamed_on_the_prefill_side():
    a, p, d = attempt(prefilled(), [TransferFailed("context gone")])
    with pytest.raises(TandemError) as e:
        asyncio.run(drain(a))
    assert status_of(e.value) is Status.TRANSFER_FAILED and e.value.worker.name == "prefill-0"
    assert d.aborted == ["r"]


@pytest.mark.parametrize("error", [TransferFailed("late"), Unavailable("decode died")])
def test_a_decode_failure_after_its_first_token_is_the_decode_workers(error):
    a, p, d = attempt(prefilled(), [Token(8, None, None), error])
    with pytest.raises(TandemError) as e:
        asyncio.run(drain(a))
    assert e.value.worker.name == "decode-0" and d.aborted == ["r"]


def test_a_decode_stream_that_ends_without_a_finish_reason_is_the_decode_workers():
    a, p, d = attempt(prefilled(), [Token(8, None, None)])
    with pytest.raises(Unavailable, match="without a finish reason") as e:
        asyncio.run(drain(a))
    assert e.value.worker.name == "decode-0" and d.aborted == ["r"]


def test_leaving_mid_stream_aborts_the_generation_request():
    a, p, d = attempt(prefilled(), [Token(8, None, None), Token(9, None, None), Token(10, None, "length")])

    async def two():
        async with a:
            return [await a.next(), await a.next()]
    toks = asyncio.run(two())
    assert [t.token for t in toks] == [7, 8]
    assert d.aborted == ["r"] and p.aborted == []


def test_decode_workers_that_report_no_pages_are_routed_by_running_requests():
    from control.router import Demand, KvAware, LeastLoaded
    from tandem.wire import WorkerStats

    def worker(name, role, running=0, queued=0):
        w = WorkerState(name, role, f"{name}:1", None, healthy=True, running=running, inflight_tokens=queued)
        w.stats = WorkerStats(role=role, host="h", running=running)  # TensorRT-LLM: no pages_total
        return w

    decodes = [worker("decode-0", "decode", running=3), worker("decode-1", "decode", running=1)]
    prefills = [worker("prefill-0", "prefill", queued=500), worker("prefill-1", "prefill", queued=20)]
    demand = Demand(tokens=100, pages=1000, tokens_per_page=16, cached=lambda w: 0)
    for router in (LeastLoaded(), KvAware()):
        d, p = router.pick_pair(prefills, decodes, demand)
        assert (d.name, p.name) == ("decode-1", "prefill-1"), type(router).__name__


@pytest.mark.parametrize("field, value", [("top_logprobs", 2), ("prompt_logprobs", True), ("repetition_penalty", 1.2),
                                          ("min_p", 0.1), ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
                                          ("logit_bias", ((5, 1.0),)), ("guide", Guide(GuideKind.REGEX, "[0-9]+")),
                                          ("bad_words", ((5,), (6, 7))), ("cache_salt", "tenant-a")])
def test_a_sampling_field_tensorrt_llm_is_not_given_is_refused_before_any_worker_is_asked(field, value):
    a, p, d = attempt(prefilled(), [])
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    a.params = SamplingParams(max_tokens=4, **extra, **{field: value})
    with pytest.raises(InvalidArgument, match=f"{field} is not supported"):
        asyncio.run(drain(a))
    assert p.sent == [] and d.sent == [] and p.aborted == []
