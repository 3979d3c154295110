"""A prefill backlog many times longer than any timer on the data path loses no request.

Reservations no longer expire: a request's pages are held for exactly as long as the request lives,
however long its prompt waits in a live prefill worker's queue. The stack runs with the only timers
left (the KV transfer timeout and the NIXL fence timeout) cut to 1 s, and a backlog of long prompts
that keeps the one prefill worker busy for well over ten times that, with short requests sent while
it lasts. Every request completes, every text equals single-process greedy, and afterwards no page
is in use.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request

import yaml

from engine.generate import run_generation
from tandem.sampling_params import SamplingParams
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import pages_used, post

LONG = "Summarize the following log in one line. " + " ".join(
    f"At step {i} the pump at station {i % 7} reported pressure {100 + i} and flow {i * 3 % 50}." for i in range(70))
SHORT = ["The capital of France is", "Two plus two is", "The color of the sky is"]


def test_a_long_prefill_backlog_loses_nothing(built_engines, tmp_path, default_engine):
    cfg = tmp_path / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"handoff": {"transfer_timeout_s": 1.0, "fence_timeout_s": 1.0},
                                   "health": {"stall_s": 30.0},
                                   "prefix_cache": {"enabled": False}}))  # every long prompt is computed in full
    ids = default_engine.tokenizer.encode(LONG)
    assert len(ids) > 1200
    want_long = run_generation(default_engine, ids, SamplingParams(max_tokens=8)).text
    want_short = {p: run_generation(default_engine, default_engine.tokenizer.encode(p),
                                    SamplingParams(max_tokens=8)).text for p in SHORT}
    s = start_serve(built_engines, tmp_path / "serve", "--config", str(cfg))
    try:
        jobs = [LONG] * 6 + SHORT * 2
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = {}
            for i, prompt in enumerate(jobs):
                futures[pool.submit(post, s.http, "/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                                                      "temperature": 0})] = prompt
                if prompt is LONG:
                    time.sleep(0.05)  # the long ones queue first; the short ones arrive behind them
            results = [(futures[f], f.result(timeout=600)) for f in futures]
        backlog_s = time.monotonic() - t0
        for prompt, (status, body) in results:
            assert status == 200, body
            assert body["choices"][0]["text"] == (want_long if prompt is LONG else want_short[prompt])
        assert backlog_s > 10 * 1.0, f"the backlog ({backlog_s:.1f}s) must outlast the timers many times over"
        time.sleep(2.5)  # two heartbeats: the pushed stats are current
        used = pages_used(s.http)  # every pool's pages are back: decode's, and prefill's (its prefix cache)
        assert 'tandem_kv_pages_used{role="decode",worker="decode-0"}' in used and set(used.values()) == {0.0}, used
    finally:
        stop_serve(s)
