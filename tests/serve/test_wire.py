"""The control messages parse back to what was sent, and a wrong key or value type is a WireError (status
PROTOCOL_ERROR: the sender's fault, which the orchestrator's client sees as the server's) that names the
field (the checks are cached per class and hint: the second message must be checked as the first)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, make_dataclass

import pytest

from tandem.guides import Guide, GuideKind
from tandem.logprobs import Logprob
from tandem.sampling_params import SamplingParams
from tandem.status import Status, status_of
from tandem.wire import WIRE, Open, Start, Token, WireError, decode_reply, decode_request, encode_reply, encode_request
from tandem.wire_parse import fingerprint


def test_requests_and_replies_round_trip():
    msg = Open("r1", [1, 2, 3], SamplingParams(max_tokens=4), output_ids=[7], writer="prefill-0")
    assert decode_request(encode_request(msg)) == msg
    for tok in (Token(5, -0.25, None), Token(None, None, "stop", cached_tokens=16)):
        reply = decode_reply(encode_reply(tok))
        assert reply.status is Status.OK and reply.body == tok


def test_logprob_reports_round_trip():
    report = Logprob(-0.5, (3, 9), (-0.5, -1.25))
    for tok in (Token(3, -0.5, None, top=report, prompt_logprobs=[Logprob(-2.0, rank=7), report]),):
        assert decode_reply(encode_reply(tok)).body == tok
    params = SamplingParams(max_tokens=4, top_logprobs=2, prompt_logprobs=True, min_p=0.1, repetition_penalty=1.2,
                            logit_bias=((3, -100.0), (9, 2.5)))
    assert decode_request(encode_request(Open("r", [1, 2], params))).sampling == params
    raw = json.loads(encode_request(Open("r", [1, 2], params)))
    for bad, why in [([[3, 1.0, 2]], "2 items"), ([[3.5, 1.0]], "expected int"), ([[3, "x"]], "expected float"),
                     ([[9, 1.0], [3, 1.0]], "distinct")]:
        raw["body"]["sampling"]["logit_bias"] = bad
        with pytest.raises(WireError, match=why) as e:
            decode_request(json.dumps(raw))
        assert status_of(e.value) is Status.PROTOCOL_ERROR
    raw = json.loads(encode_reply(Token(3, -0.5, None, top=report)))
    raw["body"]["top"]["top_ids"] = ["x"]
    with pytest.raises(WireError, match="top_ids"):
        decode_reply(json.dumps(raw))


def test_a_guide_travels_with_its_params_and_a_bad_one_is_refused():
    params = SamplingParams(max_tokens=4, guide=Guide(GuideKind.JSON_SCHEMA, '{"type": "object"}'))
    assert decode_request(encode_request(Open("r", [1, 2], params))).sampling == params
    raw = json.loads(encode_request(Open("r", [1, 2], params)))
    assert raw["body"]["sampling"]["guide"] == {"kind": "json_schema", "text": '{"type": "object"}'}
    for bad, why in [({"kind": "xml", "text": "x"}, "not one of"), ({"kind": "json_schema", "text": "[1]"}, "object"),
                     ({"kind": "regex"}, "needs its text")]:
        raw["body"]["sampling"]["guide"] = bad
        with pytest.raises(WireError, match=why) as e:
            decode_request(json.dumps(raw))
        assert status_of(e.value) is Status.PROTOCOL_ERROR


def _start(**body) -> bytes:
    return json.dumps({"wire": WIRE, "type": "start", "body": {"request_id": "r", "lease": "l", "token": 1, **body}}).encode()


def test_an_integer_is_a_float_but_nothing_else_passes_for_another_type():
    assert decode_request(_start(logprob=-1)).logprob == -1.0
    assert decode_request(_start(logprob=None)).logprob is None
    assert decode_request(_start()) == Start("r", "l", 1)
    for bad, field in (({"token": True}, "Start.token"), ({"token": 1.5}, "Start.token"),
                       ({"logprob": "x"}, "Start.logprob"), ({"lease": 3}, "Start.lease")):
        for _ in range(2):  # once to fill the per-hint cache, once through it
            with pytest.raises(WireError, match=field) as e:
                decode_request(_start(**bad))
            assert status_of(e.value) is Status.PROTOCOL_ERROR


def test_unknown_missing_and_nested_fields_are_named():
    with pytest.raises(WireError, match=r"unknown fields \['extra'\]"):
        decode_request(_start(extra=1))
    with pytest.raises(WireError, match="missing field 'lease'"):
        decode_request(json.dumps({"wire": WIRE, "type": "start", "body": {"request_id": "r", "token": 1}}))
    body = json.loads(encode_request(Open("r", [1], SamplingParams())))
    body["body"]["prompt_ids"] = [1, "2"]
    with pytest.raises(WireError, match="Open.prompt_ids: expected a list of integers"):
        decode_request(json.dumps(body))
    body["body"]["prompt_ids"], body["body"]["sampling"]["max_tokens"] = [1], "many"
    with pytest.raises(WireError, match="SamplingParams.max_tokens"):
        decode_request(json.dumps(body))


def test_a_request_of_another_schema_is_refused_naming_both_schemas():
    raw = json.loads(encode_request(Start("r", "l", 1)))
    for other in ({**raw, "wire": "0123456789ab"}, {k: v for k, v in raw.items() if k != "wire"}):
        with pytest.raises(WireError, match=f"wire schema .*this worker's '{WIRE}'.*different Tandem builds") as e:
            decode_request(json.dumps(other))
        assert status_of(e.value) is Status.PROTOCOL_ERROR
    with pytest.raises(WireError, match="request must be"):
        decode_request(json.dumps({**raw, "extra": 1}))


def test_the_fingerprint_follows_every_field_nested_message_and_enum_value():
    Kind = enum.Enum("Kind", {"A": "a"})
    More = enum.Enum("Kind", {"A": "a", "B": "b"})

    @dataclass(frozen=True)
    class Inner:
        n: int

    def outer(*extra, inner=Inner, kind=Kind):
        return make_dataclass("Outer", [("inner", inner | None), ("kind", kind), *extra], frozen=True)

    base = fingerprint(outer(), Status)
    assert base == fingerprint(outer(), Status)  # deterministic
    changed = [fingerprint(outer(("x", str)), Status),  # a field added
               fingerprint(outer(inner=make_dataclass("Inner", [("n", float)])), Status),  # a nested field retyped
               fingerprint(outer(inner=make_dataclass("Inner", [("m", int)])), Status),  # ... renamed
               fingerprint(outer(kind=More), Status),  # an enum value added
               fingerprint(outer())]  # a status table of another shape
    assert len({base, *changed}) == len(changed) + 1
