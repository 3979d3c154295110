"""Co-located replicas go through the same router and resume a failed request exactly as the
disaggregated path does: kill the replica serving a stream and the answer still arrives, every token
once, from the other replica."""

from __future__ import annotations

import re
import urllib.request

from engine.generate import run_generation
from tandem.sampling_params import SamplingParams
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import post
from tests.serve.kill import KillServing


def test_two_colocated_replicas_serve_and_resume_when_one_is_killed(built_engines, tmp_path, default_engine):
    prompt = "Write a long story about a dragon who learns to paint."
    want = run_generation(default_engine, default_engine.tokenizer.encode(prompt), SamplingParams(max_tokens=80))
    assert len(want.token_ids) == 80
    s = start_serve(built_engines, tmp_path / "serve", "--mode", "colocated", "--replicas", "2")
    try:
        assert set(s.workers()) == {"generate-0", "generate-1"}
        assert {tuple(w["cpus"]) for w in s.workers().values()} == {(0,), (1,)}  # each on its own core

        kill = KillServing(s, "generate")  # the replica serving it, at the 5th token
        status, events = post(s.http, "/v1/completions", {"prompt": prompt, "max_tokens": 80, "temperature": 0,
                                                          "stream": True}, on_event=kill)
        assert status == 200 and kill.killed
        assert "".join(e["choices"][0]["text"] for e in events) == want.text
        with urllib.request.urlopen(s.http + "/metrics") as r:
            assert re.search(r'^tandem_recoveries_total\{role="generate"\} [1-9]', r.read().decode(), re.M)
    finally:
        stop_serve(s)
