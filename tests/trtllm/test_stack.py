"""TensorRT-LLM role workers driven by Tandem's orchestrator, end to end: real Triton servers running
engine/triton/trtllm_model.py and the real adapter, `tandem serve --backend tensorrt-llm` with its
doors, the real tokenizer and model.

The workers import tests/trtllm/fake_trtllm/tensorrt_llm (copied beside each model.py), a test double of TensorRT-LLM's recorded API
surface on Tandem's own engine: it is NOT TensorRT-LLM, and nothing here is a TensorRT-LLM or GPU
result (tests/trtllm/test_real.py is the real test). The double recomputes the K/V on the generation
side; what these tests show is the orchestration: the protocol, routing, failover, cancellation.

The workers run with TANDEM_FAKE_TRTLLM_DROP_CONTEXTS=1: each prefill worker loses the context of its
first request, so that request's pull fails (TRANSFER_FAILED) and the orchestrator prefills it again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import os
import re
import shutil
import time
import urllib.request

import pytest

from control.worker_client import TrtllmDecodeClient, TrtllmPrefillClient
from engine.generate import run_generation
from ops.local_workers import WorkerSet
from tandem.sampling_params import SamplingParams
from tests.conftest import leak_check, leak_snapshot, start_serve, stop_serve
from tests.serve.clients import grpc_stream, post

FAKE = os.path.join(os.path.dirname(__file__), "fake_trtllm")
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "Three facts about the moon:"]


@pytest.fixture(scope="module")
def trtllm_engines(tmp_path_factory):
    from builder.build import BuildRequest
    from builder.trtllm_build import build_trtllm

    out = tmp_path_factory.mktemp("trtllm") / "engines"
    build_trtllm(BuildRequest(model="smollm2-135m", out=str(out)), dry_run=False, log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def stack(trtllm_engines, tmp_path_factory):
    """2 TensorRT-LLM prefill and 2 decode workers (the double), and `tandem serve` in front of them."""
    before = leak_snapshot()
    work = tmp_path_factory.mktemp("trtllm-workers")
    holds = work / "tmp"
    holds.mkdir()
    env = {"TANDEM_FAKE_TRTLLM_DROP_CONTEXTS": "1", "TMPDIR": str(holds)}
    ws = WorkerSet(str(trtllm_engines), str(work), {"prefill": 2, "decode": 2}, backend="tensorrt-llm", env=env)
    try:
        start_with_double(ws)
        config = work / "deployment.yaml"
        config.write_text(json.dumps({"prefill": {"count": 0, "urls": ws.urls("prefill")},
                                      "decode": {"count": 0, "urls": ws.urls("decode")}}))
        s = start_serve(trtllm_engines, tmp_path_factory.mktemp("serve-trtllm"), "--backend", "tensorrt-llm",
                        "--config", str(config))
        try:
            s.ws = ws
            yield s
        finally:
            stop_serve(s)
    finally:
        ws.stop()
    assert leak_check(before) == []
    # every context the prefill workers held was pulled once (a stopped worker's folder may remain)
    assert [f for d in holds.iterdir() for f in os.listdir(d)] == []


def start_with_double(ws: WorkerSet) -> None:
    """Render the workers' repositories, put the double beside each model.py (Triton's Python stub
    imports from there; it ignores PYTHONPATH), start the workers."""
    ws.prepare()
    for name, spec in ws.specs.items():
        shutil.copytree(os.path.join(FAKE, "tensorrt_llm"),
                        os.path.join(ws.repo, f"{spec.role}_{spec.index}", spec.role, "1", "tensorrt_llm"))
    for name in ws.specs:
        ws.launch(name)
    for name in ws.specs:
        ws.wait_ready(name)


@pytest.fixture(scope="module")
def expected(default_engine):
    """Tandem's own engine's greedy answers (what push and pull serve)."""
    return {p: run_generation(default_engine, default_engine.tokenizer.encode(p), SamplingParams(max_tokens=24)).text
            for p in PROMPTS}


def metric(http: str, name: str) -> dict[str, float]:
    with urllib.request.urlopen(http + "/metrics") as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}\{{(.*)\}} ([\d.e+-]+)$', text, re.M)}


def worker_running(ws: WorkerSet) -> dict[str, int]:
    async def ask():
        out = {}
        for name, server in sorted(ws.servers.items()):
            client = (TrtllmPrefillClient if name.startswith("prefill") else TrtllmDecodeClient)(server.grpc_url)
            try:
                out[name] = (await client.stats()).running
            finally:
                await client.close()
        return out
    return asyncio.run(ask())


def test_greedy_answers_equal_tandems_own_engine_through_both_doors(stack, expected):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        grpc = list(pool.map(lambda p: "".join(grpc_stream(stack.grpc, p, 24)), PROMPTS * 2))
        http = list(pool.map(lambda p: post(stack.http, "/v1/completions",
                                            {"prompt": p, "max_tokens": 24, "temperature": 0}), PROMPTS))
    assert grpc == [expected[p] for p in PROMPTS * 2]
    assert [(status, body["choices"][0]["text"]) for status, body in http] == [(200, expected[p]) for p in PROMPTS]
    waits = metric(stack.http, "tandem_kv_wait_seconds_count")
    assert waits.get('handoff="trtllm"', 0) >= len(PROMPTS) * 3 and 'handoff="push"' not in waits, waits


def test_a_sampling_field_tensorrt_llm_is_not_given_is_a_client_error_naming_it(stack):
    status, body = post(stack.http, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4,
                                                        "repetition_penalty": 1.3})
    assert status == 400 and "repetition_penalty is not supported" in body["error"]["message"], body


def test_a_failed_pull_is_prefilled_again_with_the_exact_answer(stack, expected):
    """Each prefill worker lost its first context: those pulls failed with TRANSFER_FAILED, were blamed on
    the prefill side and prefilled again (prompt + the first token, already streamed); the clients saw
    nothing of it."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: "".join(grpc_stream(stack.grpc, p, 24)), PROMPTS))
    assert got == [expected[p] for p in PROMPTS]
    recoveries = metric(stack.http, "tandem_recoveries_total")
    assert recoveries.get('role="prefill"', 0) >= 1, recoveries
    log = open(stack.log_path, encoding="utf-8").read()
    assert re.search(r"RequestError: fake tensorrt_llm: the context \d+ is not held any more.*resuming after 1 token",
                     log), log[-3000:]


def test_cancel_mid_stream_ends_the_requests_on_every_worker(stack):
    stream = sse_texts(stack.http, {"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True})
    for _ in range(5):  # a few tokens in: the decode worker is streaming
        next(stream)
    assert sum(worker_running(stack.ws).values()) >= 1
    stream.close()  # the client goes away
    deadline = time.monotonic() + 60
    while sum(worker_running(stack.ws).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_running(stack.ws) == {"decode-0": 0, "decode-1": 0, "prefill-0": 0, "prefill-1": 0}
    assert sum(metric(stack.http, "tandem_requests_in_flight").values()) == 0


def sse_texts(http_url: str, body: dict):
    """The texts of one streamed completion (OpenAI door, SSE) as they arrive."""
    conn = http.client.HTTPConnection(http_url.removeprefix("http://"))
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        while line := resp.readline():
            data = line.decode().strip().removeprefix("data:").strip()
            if data == "[DONE]":
                return
            if data:
                yield json.loads(data)["choices"][0]["text"]
    finally:
        conn.close()


def test_a_decode_worker_killed_mid_stream_resumes_on_the_other_with_the_exact_tokens(stack, default_engine):
    prompt = "Write a long story about a dragon who learns to paint."
    want = run_generation(default_engine, default_engine.tokenizer.encode(prompt),
                          SamplingParams(max_tokens=80, ignore_eos=True))
    before = metric(stack.http, "tandem_recoveries_total").get('role="decode"', 0)
    pieces = []
    for text in sse_texts(stack.http, {"prompt": prompt, "max_tokens": 80, "temperature": 0, "ignore_eos": True}):
        pieces.append(text)
        if len(pieces) == 5:  # a few tokens in, the decode worker streaming it dies
            victim = next(name for name, n in worker_running(stack.ws).items() if name.startswith("decode") and n)
            stack.ws.servers[victim].kill()
            killed = victim
    stack.ws.servers[killed].stop()  # what the killed group left in shared memory goes (its process is gone)
    assert "".join(pieces) == want.text
    assert metric(stack.http, "tandem_recoveries_total").get('role="decode"', 0) >= before + 1
    status, body = post(stack.http, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"]
