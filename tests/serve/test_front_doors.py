"""A running `tandem serve` (1P1D, default model) through unmodified clients of both front doors."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from engine.generate import run_generation
from tandem.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from tests.serve.clients import ensemble_inputs, grpc_infer, grpc_stream, http_infer, post
from tests.serve.test_cors import CHAT, PAGE, call, preflight

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "Three facts about the moon:"]


def greedy_text(engine, ids, max_tokens) -> str:
    return run_generation(engine, ids, SamplingParams(max_tokens=max_tokens)).text


@pytest.fixture(scope="module")
def expected(default_engine):
    return {p: greedy_text(default_engine, default_engine.tokenizer.encode(p), 24) for p in PROMPTS}


def test_tritonclient_grpc_non_streaming_matches_tandem_generate(served, expected):
    for p in PROMPTS:
        assert grpc_infer(served.grpc, p, 24) == expected[p]


def test_tritonclient_grpc_streaming_deltas_concatenate_to_the_answer(served, expected):
    for p in PROMPTS[:2]:
        parts = grpc_stream(served.grpc, p, 24)
        assert parts[0] != "" and "".join(parts) == expected[p]
        assert len(parts) > 5  # one response per piece of new text, not one blob


def test_tritonclient_http_matches(served, expected):
    assert http_infer(served.http, PROMPTS[0], 24) == expected[PROMPTS[0]]


def test_openai_completions_and_chat_stream_and_not(served, default_engine, expected):
    status, body = post(served.http, "/v1/completions", {"model": "ensemble", "prompt": PROMPTS[1],
                                                         "max_tokens": 24, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == expected[PROMPTS[1]]
    assert body["usage"]["completion_tokens"] == 24 and body["usage"]["prompt_tokens"] > 5
    status, events = post(served.http, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0,
                                                           "stream": True})
    assert status == 200 and "".join(e["choices"][0]["text"] for e in events) == expected[PROMPTS[1]]
    question = "What is the capital of France?"
    want = greedy_text(default_engine, default_engine.tokenizer.encode_chat([ChatMessage("user", question)]), 32)
    msgs = [{"role": "user", "content": question}]
    status, body = post(served.http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 32, "temperature": 0})
    assert status == 200 and body["choices"][0]["message"]["content"] == want
    assert body["choices"][0]["finish_reason"] == "stop"
    status, events = post(served.http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 32, "temperature": 0,
                                                                "stream": True, "stream_options": {"include_usage": True}})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"]
    assert "".join(d.get("content", "") for d in deltas) == want
    assert events[-1]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]


def test_sixteen_concurrent_streams_all_complete_correctly(served, expected):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: "".join(grpc_stream(served.grpc, p, 24)), prompts))
    assert results == [expected[p] for p in prompts]


def test_model_config_metadata_and_health(served):
    c = grpcclient.InferenceServerClient(served.grpc)
    try:
        cfg = c.get_model_config("ensemble").config
        assert cfg.model_transaction_policy.decoupled and cfg.max_batch_size > 0
        names = {i.name: i.optional for i in cfg.input}
        assert names["text_input"] is False and names["max_tokens"] is False
        assert all(names[n] for n in ("stream", "exclude_input_in_output", "min_tokens", "min_length", "temperature",
                                      "top_k", "top_p", "seed", "random_seed", "stop_words", "end_id", "pad_id"))
        assert [o.name for o in cfg.output][0] == "text_output"
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("ensemble")
        assert not c.is_model_ready("other")
        assert set(c.get_server_metadata().extensions) == {"model_configuration", "statistics", "schedule_policy"}
    finally:
        c.close()
    with urllib.request.urlopen(served.http + "/metrics") as r:
        text = r.read().decode()
    for name in ("tandem_ttft_seconds", "tandem_itl_seconds", "tandem_tpot_seconds", "tandem_e2e_seconds",
                 "tandem_queue_seconds", "tandem_prefill_seconds", "tandem_kv_transfer_bytes_total",
                 "tandem_kv_transfer_seconds", "tandem_kv_pages_used", "tandem_requests_in_flight"):
        assert name in text, name
    assert "\ntandem_kv_tokens_per_page 16.0\n" in text  # the default engines' page size, for clients' sums
    with urllib.request.urlopen(served.http + "/v1/models") as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["smollm2-135m"]  # the served model's name


def test_the_repository_index_holds_the_served_model_and_model_control_is_refused_on_both_doors(served):
    """tritonclient's repository calls: the index (all, or only ready) is the one model, READY; load and
    unload are refused naming why, as 405 over HTTP and UNIMPLEMENTED over gRPC; every model's
    statistics (HTTP, no model named) are the one model's."""
    ready = [{"name": "ensemble", "version": "1", "state": "READY", "reason": ""}]
    g, h = grpcclient.InferenceServerClient(served.grpc), httpclient.InferenceServerClient(served.http[len("http://"):])
    try:
        got = g.get_model_repository_index(as_json=True)["models"]
        assert [{"reason": "", **m} for m in got] == ready  # protobuf's JSON leaves out the empty reason
        assert h.get_model_repository_index() == ready
        for client in (g, h):
            for call in (client.load_model, client.unload_model):
                with pytest.raises(InferenceServerException, match="serves the one model it started with") as e:
                    call("ensemble")
                assert e.value.status() in ("StatusCode.UNIMPLEMENTED", "405"), e.value.status()
    finally:
        g.close()
        h.close()
    h = httpclient.InferenceServerClient(served.http[len("http://"):])
    try:  # every model's statistics (no name): the one model's
        every, one = h.get_inference_statistics(), h.get_inference_statistics("ensemble")
        assert [m["name"] for m in every["model_stats"]] == ["ensemble"]
        assert every["model_stats"][0]["inference_stats"] == one["model_stats"][0]["inference_stats"]
    finally:
        h.close()
    status, reply = post(served.http, "/v2/repository/index", {"ready": True})
    assert status == 200 and reply == ready
    status, reply = post(served.http, "/v2/repository/index", {"ready": "yes"})
    assert status == 400 and "ready" in reply["error"], reply


def _grpc_error(url, inputs, model="ensemble") -> InferenceServerException:
    c = grpcclient.InferenceServerClient(url)
    try:
        with pytest.raises(InferenceServerException) as e:
            c.infer(model, inputs)
        return e.value
    finally:
        c.close()


def test_bad_input_gets_the_protocols_error_while_good_requests_go_on(served, expected, default_engine):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        good = pool.submit(lambda: "".join(grpc_stream(served.grpc, PROMPTS[2], 24)))
        g = served.grpc
        too_long = "word " * 9000
        cases = {
            "missing text_input": ([x for x in ensemble_inputs(grpcclient, "hi", 4, False) if x.name() != "text_input"],
                                   "missing required input 'text_input'"),
            "wrong type": (ensemble_inputs(grpcclient, "hi", 4, False,
                                           {"max_tokens": (np.array([[4.0]], dtype=np.float32), "FP32")}),
                           "'max_tokens' must be INT32, got FP32"),
            "empty prompt": (ensemble_inputs(grpcclient, "", 4, False), "prompt is empty"),
            "over the context": (ensemble_inputs(grpcclient, too_long, 4, False), "model's context is 8192"),
            "max_tokens 0": (ensemble_inputs(grpcclient, "hi", 0, False), "max_tokens must be an integer >= 1"),
            "max_tokens huge": (ensemble_inputs(grpcclient, "hi", 100000, False), "ask for at most"),
        }
        for name, (inputs, message) in cases.items():
            err = _grpc_error(g, inputs)
            assert err.status() == "StatusCode.INVALID_ARGUMENT" and message in err.message(), (name, err)
        err = _grpc_error(g, ensemble_inputs(grpcclient, "hi", 4, False), model="llama-70b")
        assert err.status() == "StatusCode.NOT_FOUND" and "unknown model 'llama-70b'" in err.message()
        http_cases = [
            ({"prompt": "", "max_tokens": 4}, "prompt is empty"),
            ({"prompt": too_long, "max_tokens": 4}, "model's context is 8192"),
            ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
            ({"prompt": "hi", "max_tokens": "many"}, "'max_tokens' must be an integer"),
            ({"prompt": "hi", "temperature": -1}, "temperature must be >= 0"),
        ]
        for body, message in http_cases:
            status, err = post(served.http, "/v1/completions", body)
            assert status == 400 and message in err["error"]["message"], (body, err)
            assert err["error"]["type"] == "invalid_request_error"
        status, err = post(served.http, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "model": "gpt-4"})
        assert status == 404 and "unknown model 'gpt-4': the model does not exist" in err["error"]["message"], err
        status, err = post(served.http, "/v1/chat/completions", None, raw=b'{"messages": [')
        assert status == 400 and "not valid JSON" in err["error"]["message"]
        status, err = post(served.http, "/v1/chat/completions", {"messages": []})
        assert status == 400 and "'messages' must be a non-empty list" in err["error"]["message"]
        assert good.result(timeout=120) == expected[PROMPTS[2]]
    assert grpc_infer(served.grpc, PROMPTS[0], 24) == expected[PROMPTS[0]]


def test_workers_run_nicer_than_the_front_door(served):
    """deployment.worker_nice (default 10): each worker's python stubs, where the model computes, run
    below the front door's priority in every thread, and so does the server itself, and its session's
    scheduling group where the kernel has autogroups. (Triton sets its own model-instance threads'
    priority, which only hand requests to the stubs.)"""
    import os

    import psutil

    from ops.deployment import Deployment

    want = min(19, psutil.Process(served.proc.pid).nice() + Deployment().worker_nice)  # the serve process's own
    for w in served.workers().values():
        server = psutil.Process(w["pid"])
        assert server.nice() == want
        if os.path.exists(f"/proc/{server.pid}/autogroup"):  # its own session's group is as nice
            with open(f"/proc/{server.pid}/autogroup") as f:
                assert f.read().split()[-1] == str(want)
        stubs = server.children(recursive=True)
        assert stubs and all(p.name().startswith("triton_python") for p in stubs)
        for p in stubs:
            for t in os.listdir(f"/proc/{p.pid}/task"):  # every thread: nice is per thread on Linux
                assert os.getpriority(os.PRIO_PROCESS, int(t)) == want, (p.name(), t)


def test_without_cors_no_page_is_told_it_may_read(served):
    """CORS is off by default (frontdoor/cors.py): a preflight finds no OPTIONS route, and an answer to
    a page's request (tests/serve/test_cors.py) names no origin that may read it."""
    status, headers, body = preflight(served.http, PAGE)
    assert status == 405 and "access-control-allow-origin" not in headers, body
    status, headers, _ = call(served.http, "POST", "/v1/chat/completions", {"Origin": PAGE}, CHAT)
    assert status == 200 and "access-control-allow-origin" not in headers
