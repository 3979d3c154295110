"""2 prefill + 2 decode workers on one machine: load spreads over all four, and a decode worker that
dies mid-answer loses nothing: the stream resumes on the other one without repeating a token."""

from __future__ import annotations

import concurrent.futures
import json
import re
import urllib.request

import pytest

from engine.generate import run_generation
from tandem.guides import Guide, GuideKind
from tandem.sampling_params import SamplingParams
from tests.serve.clients import grpc_stream, post
from tests.serve.kill import KillServing, worker_requests
from tests.conftest import start_serve, stop_serve

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "Three facts about the moon:"]


@pytest.fixture(scope="module")
def served_2p2d(built_engines, tmp_path_factory):
    s = start_serve(built_engines, tmp_path_factory.mktemp("serve-2p2d"), "--prefill", "2", "--decode", "2")
    yield s
    stop_serve(s)


def test_load_spreads_over_all_four_workers(served_2p2d, default_engine):
    expected = {p: run_generation(default_engine, default_engine.tokenizer.encode(p),
                                  SamplingParams(max_tokens=16)).text for p in PROMPTS}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda p: "".join(grpc_stream(served_2p2d.grpc, p, 16)), prompts))
    assert got == [expected[p] for p in prompts]
    counts = worker_requests(served_2p2d.http)
    assert set(counts) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert all(n >= 2 for n in counts.values()), counts


def test_a_decode_worker_dying_mid_stream_loses_no_token(served_2p2d, default_engine):
    prompt = "Write a long story about a dragon who learns to paint."
    want = run_generation(default_engine, default_engine.tokenizer.encode(prompt), SamplingParams(max_tokens=80))
    assert len(want.token_ids) == 80  # long enough to be interrupted

    kill = KillServing(served_2p2d, "decode")  # the decode worker serving it, at the 5th token
    status, events = post(served_2p2d.http, "/v1/completions",
                          {"prompt": prompt, "max_tokens": 80, "temperature": 0, "stream": True}, on_event=kill)
    assert status == 200 and kill.killed
    assert "".join(e["choices"][0]["text"] for e in events) == want.text
    assert recoveries(served_2p2d) >= 1
    # still serving, on what is left
    status, body = post(served_2p2d.http, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"]


def test_a_sampled_request_resumes_with_exactly_its_own_tokens(served_2p2d, default_engine):
    """Temperature 0.8 with a seed: the decode worker serving it dies mid-stream, the stream resumes on
    the other one, and the client gets exactly the tokens the request gives without any failure (the
    sampler draws token n from (seed, n) alone, so the resumed worker draws what the dead one would)."""
    prompt = "Tell me a story about a fox and a crow."
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 1234, "max_tokens": 80, "ignore_eos": True}
    want = run_generation(default_engine, default_engine.tokenizer.encode(prompt),
                          SamplingParams(max_tokens=80, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True))
    assert len(want.token_ids) == 80  # long enough to be interrupted
    status, body = post(served_2p2d.http, "/v1/completions", {"prompt": prompt, **params})
    assert status == 200 and body["choices"][0]["text"] == want.text  # the uninterrupted answer

    before, kill = recoveries(served_2p2d), KillServing(served_2p2d, "decode")
    status, events = post(served_2p2d.http, "/v1/completions", {"prompt": prompt, "stream": True, **params},
                          on_event=kill)
    assert status == 200 and kill.killed
    assert "".join(e["choices"][0]["text"] for e in events) == want.text
    assert recoveries(served_2p2d) > before  # it really was resumed, not served whole before the kill


def test_n_sampled_answers_each_resume_with_exactly_their_own_tokens(served_2p2d, default_engine):
    """`n` = 2 seeded answers of one request, streamed: a decode worker serving one of them dies
    mid-stream, and each choice still carries exactly the tokens of a request of its own with seed + j."""
    prompt = "Tell me a story about a fox and a crow."
    ids = default_engine.tokenizer.encode(prompt)
    want = {j: run_generation(default_engine, ids, SamplingParams(max_tokens=60, temperature=0.8, top_p=0.95,
                                                                  seed=77 + j, ignore_eos=True)).text for j in range(2)}
    assert want[0] != want[1]
    before, kill = recoveries(served_2p2d), KillServing(served_2p2d, "decode", at=8)
    status, events = post(served_2p2d.http, "/v1/completions",
                          {"prompt": prompt, "n": 2, "stream": True, "temperature": 0.8, "top_p": 0.95, "seed": 77,
                           "max_tokens": 60, "ignore_eos": True}, on_event=kill)
    assert status == 200 and kill.killed
    got = {0: "", 1: ""}
    for e in events:
        for c in e["choices"]:
            got[c["index"]] += c["text"]
    assert got == want and recoveries(served_2p2d) > before


def test_a_guided_sampled_request_resumes_exactly_inside_its_grammar(served_2p2d, default_engine):
    """Structured output survives a decode worker's death: the worker that takes over rebuilds the
    grammar's state from the tokens already streamed, so the answer is exactly the uninterrupted one."""
    prompt = "Tell me a story about a fox and a crow, as JSON."
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                               "story": {"type": "string", "minLength": 150, "maxLength": 300}},
              "required": ["title", "story"], "additionalProperties": False}
    want = run_generation(default_engine, default_engine.tokenizer.encode(prompt), SamplingParams(
        max_tokens=160, temperature=0.8, top_p=0.95, seed=99, guide=Guide(GuideKind.JSON_SCHEMA, json.dumps(schema))))
    assert set(json.loads(want.text)) == {"title", "story"} and len(want.token_ids) > 30
    before, kill = recoveries(served_2p2d), KillServing(served_2p2d, "decode", at=12)
    status, events = post(served_2p2d.http, "/v1/completions",
                          {"prompt": prompt, "stream": True, "temperature": 0.8, "top_p": 0.95, "seed": 99,
                           "max_tokens": 160, "guided_json": schema}, on_event=kill)
    assert status == 200 and kill.killed
    assert "".join(e["choices"][0]["text"] for e in events) == want.text
    assert recoveries(served_2p2d) > before


def recoveries(serve) -> float:
    """tandem_recoveries_total over every role, from the front door's /metrics."""
    with urllib.request.urlopen(serve.http + "/metrics") as r:
        return sum(float(n) for n in re.findall(r"^tandem_recoveries_total\{[^}]*\} ([\d.]+)", r.read().decode(), re.M))
