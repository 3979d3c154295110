"""vLLM's --max-num-seqs and --max-num-batched-tokens on a real 1P1D stack: the decode worker runs at
most that many requests at once (the others wait their turn there) and every answer is the one the
engines' own limits give; a prompt longer than a prefill pass is prefilled pass by pass and answered
as in one."""

from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import start_serve, stop_serve
from tests.engine.test_exactness import LONG_TEXT
from tests.serve.clients import post

MAX_NUM_SEQS, PASS_TOKENS = 2, 64


@pytest.fixture(scope="module")
def limited(served, built_engines, tmp_path_factory):
    s = start_serve(built_engines, tmp_path_factory.mktemp("serve-limits"), "--max-num-seqs", str(MAX_NUM_SEQS),
                    "--max-num-batched-tokens", str(PASS_TOKENS))
    yield s
    stop_serve(s)


def running(http: str) -> float:
    """The decode worker's running requests, as /metrics says."""
    with urllib.request.urlopen(http + "/metrics", timeout=30) as r:
        return float(re.search(r'^tandem_worker_running\{role="decode",worker="decode-0"\} ([\d.e+]+)',
                               r.read().decode(), re.M).group(1))


def text(url: str, body: dict) -> str:
    status, got = post(url, "/v1/completions", body)
    assert status == 200, got
    return got["choices"][0]["text"]


def test_the_decode_worker_runs_at_most_max_num_seqs_at_once(limited, served):
    bodies = [{"prompt": f"Count from {i} to fifty:", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
              for i in range(2 * MAX_NUM_SEQS)]
    want = [text(served.http, b) for b in bodies]  # the engines' own limits
    seen = []
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = [pool.submit(text, limited.http, b) for b in bodies]
        while not all(a.done() for a in answers):
            seen.append(running(limited.http))
            time.sleep(0.05)
        assert [a.result() for a in answers] == want
    assert max(seen) == MAX_NUM_SEQS, seen  # the cap was reached, and never passed


def test_a_prompt_longer_than_a_pass_is_answered_as_in_one(limited, served):
    body = {"prompt": LONG_TEXT, "max_tokens": 8, "temperature": 0}
    status, got = post(limited.http, "/v1/completions", body)
    assert status == 200 and got["usage"]["prompt_tokens"] > 3 * PASS_TOKENS, got
    assert got["choices"][0]["text"] == text(served.http, body)


def test_the_limits_are_the_workers_config(limited):
    with open(f"{limited.workdir}/model_repository/decode/config.pbtxt") as f:
        decode = f.read()
    with open(f"{limited.workdir}/model_repository/prefill/config.pbtxt") as f:
        prefill = f.read()
    assert f'key: "max_batch_size" value {{ string_value: "{MAX_NUM_SEQS}" }}' in decode, decode
    assert f'key: "cpu_pass_tokens" value {{ string_value: "{PASS_TOKENS}" }}' in prefill, prefill
