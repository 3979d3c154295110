"""Co-located replicas go through the same router and resume a failed request exactly as the
disaggregated path does: kill the replica serving a stream and the answer still arrives, every token
once, from the other replica."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
import urllib.request

from engine.generate import run_generation
from tandem.sampling_params import SamplingParams
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import post


def test_two_colocated_replicas_serve_and_resume_when_one_is_killed(built_engines, tmp_path, default_engine):
    prompt = "Write a long story about a dragon who learns to paint."
    want = run_generation(default_engine, default_engine.tokenizer.encode(prompt), SamplingParams(max_tokens=80))
    assert len(want.token_ids) == 80
    s = start_serve(built_engines, tmp_path / "serve", "--mode", "colocated", "--replicas", "2")
    try:
        assert set(s.workers()) == {"generate-0", "generate-1"}
        assert {tuple(w["cpus"]) for w in s.workers().values()} == {(0,), (1,)}  # each on its own core

        def kill_the_busy_one():
            time.sleep(1.5)
            with urllib.request.urlopen(s.http + "/metrics") as r:
                text = r.read().decode()
            busy = re.search(r'^tandem_worker_requests_total\{role="generate",worker="(generate-\d)"\} 1\.0', text, re.M)
            os.killpg(s.workers()[busy.group(1)]["pid"], signal.SIGKILL)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            killer = pool.submit(kill_the_busy_one)
            status, events = post(s.http, "/v1/completions", {"prompt": prompt, "max_tokens": 80, "temperature": 0,
                                                              "stream": True})
            killer.result()
        assert status == 200
        assert "".join(e["choices"][0]["text"] for e in events) == want.text
        with urllib.request.urlopen(s.http + "/metrics") as r:
            assert re.search(r'^tandem_recoveries_total\{role="generate"\} [1-9]', r.read().decode(), re.M)
    finally:
        stop_serve(s)
