"""Hostile or odd input gets a clear 400 or a correct answer, never a 500 and never silence."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient

from engine.generate import run_generation
from tandem.sampling_params import SamplingParams
from tests.serve.clients import grpc_stream, post

EOS_FIRST = "Write one sentence about the sea."  # without the chat template, greedy answers EOS at once


def raw_post(url: str, path: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_json_is_a_400_naming_the_problem(served):
    cases = [
        (b'{"prompt": "\\ud800", "max_tokens": 2}', "lone surrogate"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
        (b'{"prompt": "hi", "max_tokens": 2' + b"}" * 1, None),  # a valid body for contrast
    ]
    for body, message in cases:
        status, reply = raw_post(served.http, "/v1/completions", body)
        if message is None:
            assert status == 200, reply
        else:
            assert status == 400 and message in reply["error"]["message"], (body[:40], reply)
    status, reply = raw_post(served.http, "/v1/chat/completions",
                             b'{"messages": [{"role": "user", "content": "\\udfff"}]}')
    assert status == 400 and "lone surrogate" in reply["error"]["message"]


def test_kserve_integers_out_of_range_are_refused_not_wrapped(served):
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]},
                       {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [3_000_000_000]}]}
    status, reply = raw_post(served.http, "/v2/models/ensemble/infer", json.dumps(body).encode())
    assert status == 400 and "3000000000 is not a INT32" in reply["error"], reply  # KServe: Triton's error shape
    body["inputs"][1]["data"] = [True]
    status, reply = raw_post(served.http, "/v2/models/ensemble/infer", json.dumps(body).encode())
    assert status == 400 and "is not a INT32" in reply["error"], reply


def test_openai_values_we_cannot_honour_are_refused_never_ignored(served):
    base = {"prompt": "hi", "max_tokens": 2}
    for extra, field in [({"n": 0}, "n"), ({"n": 65}, "n"), ({"n": 1.5}, "n"), ({"best_of": 3}, "best_of"),
                         ({"n": 40, "prompt": ["a", "b"]}, "n"), ({"prompt": ["a", 5]}, "prompt"),
                         ({"prompt": []}, "prompt"), ({"prompt": [[1, 2], []]}, "prompt"), ({"suffix": "x"}, "suffix"),
                         ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
                         ({"echo": "yes"}, "echo"), ({"stream": "yes"}, "stream"), ({"stream": 1}, "stream"),
                         ({"logit_bias": {"5": 101}}, "logit_bias"),
                         ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": [5, 1]}, "logit_bias"),
                         ({"logit_bias": {"5": "1"}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"presence_penalty": 3}, "presence_penalty"),
                         ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"ignore_eos": "true"}, "ignore_eos"), ({"stop_token_ids": [1, "x"]}, "stop_token_ids"),
                         ({"stream_options": {"include_usage": "yes"}}, "include_usage"),
                         ({"skip_special_tokens": 0}, "skip_special_tokens"),
                         ({"stream_options": {"continuous_usage_stats": 1}}, "continuous_usage_stats"),
                         ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output")]:
        status, reply = post(served.http, "/v1/completions", base | extra)
        assert status == 400 and reply["error"]["param"] == field, (extra, reply)
        assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    for extra, field in [({"response_format": {"type": "json_schema"}}, "response_format"),
                         ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
                         ({"logprobs": 1}, "logprobs"), ({"tools": [tool]}, "tool_choice"),
                         ({"tool_choice": "required"}, "tool_choice"), ({"n": 65}, "n"),
                         ({"n": 2, "best_of": 3}, "best_of")]:
        status, reply = post(served.http, "/v1/chat/completions", chat | extra)
        assert status == 400 and reply["error"]["param"] == field, (extra, reply)
    status, reply = post(served.http, "/v1/chat/completions", chat | {"response_format": {"type": "text"}, "n": 1,
                                                                      "tools": [], "tool_choice": "none"})
    assert status == 200, reply  # the values that ask for nothing are accepted


def test_unknown_and_bookkeeping_fields_are_accepted(served):
    base = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    _, plain = post(served.http, "/v1/completions", base)
    extra = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "not_a_field": 1,
             "skip_special_tokens": True}
    status, reply = post(served.http, "/v1/completions", base | extra)
    assert status == 200 and reply["choices"][0]["text"] == plain["choices"][0]["text"], reply
    with open(served.log_path, encoding="utf-8") as f:
        log = f.read()
    assert log.count("ignoring unknown request field 'not_a_field'") == 1
    post(served.http, "/v1/completions", base | extra)  # named once for the server's life, not per request
    with open(served.log_path, encoding="utf-8") as f:
        assert f.read().count("ignoring unknown request field 'not_a_field'") == 1


def test_every_http_error_has_openais_error_shape(served):
    req = urllib.request.Request(served.http + "/v1/no-such-thing", data=b"{}", method="POST")
    try:
        urllib.request.urlopen(req, timeout=30)
    except urllib.error.HTTPError as e:
        status, reply = e.code, json.loads(e.read())
    assert status == 404 and "no such route" in reply["error"]["message"], reply
    try:
        urllib.request.urlopen(served.http + "/v1/completions", timeout=30)  # GET on a POST route
    except urllib.error.HTTPError as e:
        status, allow, reply = e.code, e.headers.get("Allow"), json.loads(e.read())
    assert status == 405 and "POST" in allow and "allowed: POST" in reply["error"]["message"], reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}


def test_an_answer_whose_first_token_ends_it_still_gets_a_response_on_a_grpc_stream(served, default_engine):
    want = run_generation(default_engine, default_engine.tokenizer.encode(EOS_FIRST), SamplingParams(max_tokens=8))
    assert len(want.token_ids) == 1 and want.text == ""  # greedy: end of sequence first
    c = grpcclient.InferenceServerClient(served.grpc)
    got = []
    c.start_stream(callback=lambda result, error: got.append((result, error)))
    try:
        t = [grpcclient.InferInput(n, [1, 1], d) for n, d in (("text_input", "BYTES"), ("max_tokens", "INT32"),
                                                               ("stream", "BOOL"))]
        t[0].set_data_from_numpy(np.array([[EOS_FIRST.encode()]], dtype=np.object_))
        t[1].set_data_from_numpy(np.array([[8]], dtype=np.int32))
        t[2].set_data_from_numpy(np.array([[True]]))
        c.async_stream_infer("ensemble", t, request_id="eos")  # no empty-final-response flag asked for
    finally:
        c.stop_stream()  # waits for the stream to finish
        c.close()
    assert len(got) == 1 and got[0][1] is None, got
    assert got[0][0].as_numpy("text_output")[0][0] == b""
    assert "".join(grpc_stream(served.grpc, EOS_FIRST, 8)) == ""  # and with the flag: one final response
