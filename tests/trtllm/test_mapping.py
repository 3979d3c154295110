"""The TensorRT-LLM adapter's mappings, against the API surface recorded in engine/trtllm/api_surface.json:
Tandem SamplingParams <-> TensorRT-LLM SamplingParams kwargs, DisaggregatedParams <-> TrtllmParams on
the wire, TensorRT-LLM failures -> statuses, and the startup check of an installed tensorrt_llm.

TensorRT-LLM cannot be installed here: its objects are read by attribute, so the disaggregated params
below are plain objects with the recorded field names (test_real.py uses the real ones on a GPU)."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import replace
from types import SimpleNamespace

import pytest

from engine.trtllm.mapping import (error_for_exception, finish_reason, generation_kwargs, remaining,
                                   sampling_kwargs, tandem_sampling, token_logprob, wire_params)
from engine.trtllm.surface import SurfaceMismatch, check_installed, disagg_fields, sampling_fields, surface
from tandem.sampling_params import SamplingParams
from tandem.status import Status, TandemError
from tandem.trtllm_wire import TrtllmDecode, TrtllmParams, TrtllmPrefilled
from tandem.wire import WireError, decode_reply, decode_request, encode_reply, encode_request

SAMPLED = SamplingParams(max_tokens=40, temperature=0.7, top_k=50, top_p=0.9, seed=7, stop=("\n\n", "END"),
                         stop_token_ids=(13,), extra_eos=(2, 13), min_tokens=3, logprobs=True)
GREEDY = SamplingParams(max_tokens=8, top_k=5, top_p=0.5, ignore_eos=True)


class Style(enum.IntEnum):  # DisaggScheduleStyle's members, as recorded
    CONTEXT_FIRST = 0
    GENERATION_FIRST = 1


def disagg(**over):
    """An object with DisaggregatedParams' recorded fields, as a context_only output carries it."""
    values = dict(request_type="context_only", first_gen_tokens=[812], ctx_request_id=4242,
                  opaque_state=b"\x00\xff\x10transceiver", draft_tokens=None, disagg_request_id=None, ctx_dp_rank=0,
                  ctx_info_endpoint="10.0.0.3:4455", schedule_style=Style.CONTEXT_FIRST)
    assert set(values) == set(disagg_fields())
    return SimpleNamespace(**{**values, **over})


def test_sampling_kwargs_use_only_recorded_fields_and_say_the_same_thing():
    for p in (SAMPLED, GREEDY, SamplingParams()):
        kw = sampling_kwargs(p)
        assert set(kw) <= set(sampling_fields()), set(kw) - set(sampling_fields())
        assert kw["max_tokens"] == p.max_tokens and kw["detokenize"] is False
    kw = sampling_kwargs(SAMPLED)
    assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["seed"]) == (0.7, 50, 0.9, 7)
    assert kw["stop"] == ["\n\n", "END"] and kw["stop_token_ids"] == [13, 2] and kw["min_tokens"] == 3
    assert kw["logprobs"] == 1
    ctx = sampling_kwargs(SAMPLED, context=True)  # the context phase: its one token, no end token (min_tokens)
    assert (ctx["max_tokens"], ctx["min_tokens"]) == (1, 1) and {**ctx, "max_tokens": 40, "min_tokens": 3} == kw
    assert sampling_kwargs(GREEDY, context=True)["min_tokens"] is None
    kw = sampling_kwargs(GREEDY)
    assert (kw["top_k"], kw["top_p"], kw["temperature"]) == (1, None, None)  # greedy: top_k=1 in every release
    assert kw["ignore_eos"] is True and kw["stop"] is None and kw["logprobs"] is None


def test_sampling_round_trip():
    assert tandem_sampling(sampling_kwargs(SAMPLED)) == replace(SAMPLED, stop_token_ids=(13, 2), extra_eos=())
    assert tandem_sampling(sampling_kwargs(GREEDY)) == replace(GREEDY, top_k=0, top_p=1.0)
    assert tandem_sampling(sampling_kwargs(SamplingParams())) == SamplingParams()


def test_resumed_request_keeps_what_is_left():
    p = remaining(SAMPLED, 5)
    assert (p.max_tokens, p.min_tokens) == (35, 0)
    with pytest.raises(TandemError, match="nothing is left") as e:
        remaining(GREEDY, 8)
    assert e.value.status is Status.INVALID_ARGUMENT


def test_disaggregated_params_cross_the_wire_and_come_back_field_for_field():
    dp = disagg()
    params = wire_params(dp)
    assert params.schedule_style == "CONTEXT_FIRST" and params.opaque_state == dp.opaque_state
    msg = TrtllmDecode("r1", [1, 2, 3], SAMPLED, params)
    raw = encode_request(msg)
    assert b"transceiver" not in raw  # bytes travel as base64 text
    back = decode_request(raw)
    assert back == msg
    kw = generation_kwargs(back.params, style=lambda name: Style[name])
    expected = {k: v for k, v in vars(dp).items() if v is not None}
    assert kw == {**expected, "request_type": "generation_only"}
    reply = TrtllmPrefilled("r1", 812, -0.25, None, params, compute_seconds=0.5)
    assert decode_reply(encode_reply(reply)).body == reply


def test_fields_an_older_release_lacks_are_left_unset():
    params = wire_params(SimpleNamespace(first_gen_tokens=(9,), ctx_request_id=1, opaque_state=bytearray(b"s")))
    assert params == TrtllmParams([9], ctx_request_id=1, opaque_state=b"s")
    assert generation_kwargs(params) == dict(request_type="generation_only", first_gen_tokens=[9], ctx_request_id=1,
                                             opaque_state=b"s")


def test_malformed_descriptors_are_protocol_errors_naming_the_field():
    good = encode_request(TrtllmDecode("r", [1], GREEDY, wire_params(disagg())))
    with pytest.raises(WireError, match="opaque_state: expected base64"):
        decode_request(good.replace(b'"opaque_state":"', b'"opaque_state":"!!'))
    with pytest.raises(WireError, match="unknown fields \\['pickle'\\]"):
        decode_request(good.replace(b'"ctx_dp_rank"', b'"pickle":1,"ctx_dp_rank"'))
    with pytest.raises(TandemError, match="schedule_style must be one of"):
        decode_request(good.replace(b'"CONTEXT_FIRST"', b'"LATER"'))
    with pytest.raises(TandemError, match="first_gen_tokens"):
        TrtllmParams([], ctx_request_id=1)
    with pytest.raises(TandemError, match="ctx_request_id or disagg_request_id"):
        TrtllmParams([1])
    with pytest.raises(TandemError, match="no disaggregated_params") as e:
        wire_params(None)
    assert e.value.status is Status.INTERNAL  # TensorRT-LLM's fault, not the client's


def _tensorrt_llm_exception(path: str, base=RuntimeError):
    module, name = path.rsplit(".", 1)
    return type(name, (base,), {"__module__": module})


@pytest.mark.parametrize("exc, phase, status", [
    (ValueError("prompt longer than max_seq_len"), "submit", Status.INVALID_ARGUMENT),
    (TypeError("bad sampling"), "submit", Status.INVALID_ARGUMENT),
    (ValueError("a bug in a running request"), "generation", Status.INTERNAL),
    (_tensorrt_llm_exception("tensorrt_llm.executor.utils.RequestError")("kv transfer"), "generation",
     Status.TRANSFER_FAILED),
    (_tensorrt_llm_exception("tensorrt_llm.executor.utils.RequestError")("executor"), "context", Status.UNAVAILABLE),
    (_tensorrt_llm_exception("torch.OutOfMemoryError")("CUDA out of memory"), "context", Status.UNAVAILABLE),
    (asyncio.CancelledError(), "generation", Status.CANCELLED),
    (TimeoutError(), "context", Status.DEADLINE_EXCEEDED),
    (KeyError("x"), "context", Status.INTERNAL),
])
def test_tensorrt_llm_failures_become_statuses(exc, phase, status):
    err = error_for_exception(exc, phase)
    assert err.status is status and "TensorRT-LLM" in str(err)


def test_finish_reasons_and_logprobs():
    assert [finish_reason(r) for r in (None, "not_finished", "stop", "length")] == [None, None, "stop", "length"]
    for reason, status in (("cancelled", Status.CANCELLED), ("timeout", Status.DEADLINE_EXCEEDED),
                           ("mystery", Status.INTERNAL)):
        with pytest.raises(TandemError) as e:
            finish_reason(reason)
        assert e.value.status is status
    lp = SimpleNamespace(logprob=-1.5, rank=1)
    c = SimpleNamespace(token_ids=[5, 6], logprobs=[{5: lp, 9: SimpleNamespace(logprob=-3.0)}, -0.5])
    assert (token_logprob(c, 0), token_logprob(c, 1), token_logprob(c, 2)) == (-1.5, -0.5, None)
    assert token_logprob(SimpleNamespace(token_ids=[5], logprobs=None), 0) is None


def test_installed_package_is_checked_against_the_recorded_surface():
    dp, sp = disagg_fields(), sampling_fields()
    assert check_installed(surface()["release"], dp, sp) == []
    with pytest.raises(SurfaceMismatch, match="DisaggregatedParams.opaque_state, SamplingParams.min_tokens"):
        check_installed("1.2.1", [f for f in dp if f != "opaque_state"], [f for f in sp if f != "min_tokens"])
    warnings = check_installed("1.0.0", [f for f in dp if f != "schedule_style"], sp)
    assert "1.0.0 is installed" in warnings[0] and "schedule_style" in warnings[1]
