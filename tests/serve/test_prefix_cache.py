"""The prefix cache on real stacks (real Tritons, the real model, both front doors): greedy answers are
the same as the model's without any cache, whatever the cache does: multi-turn conversations, shared
system prompts, prompts that diverge inside a page, concurrent requests sharing a prefix, eviction in a
pool too small for the working set; under KV-aware routing (push and pull handoffs), conditional
disaggregation, co-located replicas, and with the cache off. Usage reports cached tokens; operators can flush."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from engine.generate import run_generation
from engine.transports.nixl import available as nixl_available
from tandem.sampling_params import SamplingParams
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import grpc_stream, post

SYSTEM = ("System: you are the archivist of a river town. You keep records of boats, bridges, floods and "
          "markets, you answer in plain words, and you say when a record is missing. The town has two bridges, "
          "a stone one built long ago and a wooden one rebuilt after every flood.\n")
TURNS = ["User: Which bridge is older?\nAssistant:", "User: What happens to the wooden one?\nAssistant:",
         "User: Name something you keep records of.\nAssistant:"]
MAX_TOKENS = 12
# (deployment file, extra serve flags): the same tests run against each
VARIANTS = {
    "remote-kv-aware-small-pool": ({"local_prefill_tokens": 0, "router": "kv-aware"},
                                   ("--kv-pool-bytes", str(24 << 20))),  # 34 pages: evictions
    "pull-kv-aware-small-pool": ({"local_prefill_tokens": 0, "router": "kv-aware", "handoff": {"mode": "pull"}},
                                 ("--kv-pool-bytes", str(24 << 20))),  # the pull handoff: decode reads held K/V
    "pull-nixl-kv-aware-small-pool": ({"local_prefill_tokens": 0, "router": "kv-aware", "handoff": {"mode": "pull"},
                                       "transport": "nixl"},  # ... over NIXL READ (one-sided; holds.py's fence)
                                      ("--kv-pool-bytes", str(24 << 20))),
    "conditional": ({"local_prefill_tokens": 512}, ()),
    "colocated-kv-aware": ({"mode": "colocated", "replicas": 2, "router": "kv-aware"}, ()),
    "cache-off": ({"local_prefill_tokens": 0, "prefix_cache": {"enabled": False}}, ()),
}


_NO_NIXL = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")


@pytest.fixture(scope="module", params=[pytest.param(v, marks=_NO_NIXL) if "nixl" in v else v for v in VARIANTS])
def stack(request, built_engines, tmp_path_factory):
    config, flags = VARIANTS[request.param]
    work = tmp_path_factory.mktemp(f"prefix-{request.param}")
    (work / "deployment.yaml").write_text(yaml.safe_dump(config))
    s = start_serve(built_engines, work, "--config", str(work / "deployment.yaml"), *flags)
    s.variant = request.param
    yield s
    stop_serve(s)


def reference(engine, prompt: str) -> str:
    """The model's own greedy answer, no cache anywhere (one engine, pages never kept)."""
    return run_generation(engine, engine.tokenizer.encode(prompt), SamplingParams(max_tokens=MAX_TOKENS)).text


def complete(url: str, prompt: str, **extra) -> tuple[str, dict]:
    status, body = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0} | extra)
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]


def metric(http: str, name: str) -> dict[str, float]:
    with urllib.request.urlopen(http + "/metrics") as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{name}\{{role="\w+",worker="([\w-]+)"\}} ([\d.e+-]+)', text, re.M)}


def settled(http: str, timeout_s: float = 15.0) -> dict[str, float]:
    """Pages in use per worker once every request has ended (the workers push their stats on change)."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = metric(http, "tandem_kv_pages_used")
        if all(v == 0 for v in used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def test_multi_turn_conversations_answer_as_without_a_cache(stack, default_engine):
    for c, opener in enumerate(("", "User: Tell me about the market.\nAssistant: It opens at dawn.\n")):
        history = SYSTEM + opener
        for k, turn in enumerate(TURNS):
            prompt = history + turn
            text, use = complete(stack.http, prompt)
            assert text == reference(default_engine, prompt), (stack.variant, c, k)
            cached = use["prompt_tokens_details"]["cached_tokens"]
            if stack.variant == "cache-off":
                assert cached == 0
            elif k > 0:  # the earlier turns' pages were cached (by whichever worker served them)
                assert 0 < cached < use["prompt_tokens"] and cached % 16 == 0, (stack.variant, use)
            history = prompt + text + "\n"


def test_a_cache_salt_shares_cached_pages_only_with_its_own_salt(stack, default_engine):
    """vLLM's cache_salt: a salted request takes nothing from pages cached without it or under another
    salt, and what it caches serves its own salt again (routing included); answers never change."""
    prompt = "System: the ledger of salted fish, kept apart for each merchant.\n" + SYSTEM + TURNS[1]
    want = reference(default_engine, prompt)
    cached = []
    for salt in (None, None, "merchant-a", "merchant-a", "merchant-b"):
        text, use = complete(stack.http, prompt, **({"cache_salt": salt} if salt else {}))
        assert text == want, (stack.variant, salt)
        cached.append(use["prompt_tokens_details"]["cached_tokens"])
    if stack.variant == "cache-off":
        assert cached == [0] * 5
    else:  # the first of each salt (and of no salt) computes every page; a repeat takes them from the cache
        assert cached[0] == cached[2] == cached[4] == 0 and cached[1] > 0 and cached[3] > 0, (stack.variant, cached)


def test_concurrent_requests_sharing_a_prefix_and_diverging_inside_a_page(stack, default_engine):
    questions = ["User: How old is the stone bridge?", "User: How old is the stone wall?",
                 "User: How old is the wooden bridge?", "User: Who rebuilds the bridge?",
                 "User: How old is the stone bridge? Answer in one word.", "User: List the floods."]
    prompts = [SYSTEM + q + "\nAssistant:" for q in questions]
    want = [reference(default_engine, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(stack.http, p)[0], prompts * 2))
    assert got == want * 2
    parts = grpc_stream(stack.grpc, prompts[0], MAX_TOKENS)  # the gRPC ensemble door too
    assert "".join(parts) == want[0]
    assert all(v == 0 for v in settled(stack.http).values())


def test_eviction_in_a_pool_too_small_for_the_working_set(stack, default_engine):
    if not stack.variant.endswith("small-pool"):
        pytest.skip("needs the small decode pool")
    prompts = [f"System: record book number {i}. " + SYSTEM[8:] + TURNS[i % 3] for i in range(10)]
    want = [reference(default_engine, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda p: complete(stack.http, p)[0], prompts + prompts[::-1]))
    assert got == want + want[::-1]
    assert metric(stack.http, "tandem_prefix_cache_evicted_pages_total")["decode-0"] > 0
    assert all(v == 0 for v in settled(stack.http).values())  # no page leaked
    cached, total = metric(stack.http, "tandem_prefix_cache_pages"), metric(stack.http, "tandem_kv_pages_total")
    assert 0 < cached["decode-0"] <= total["decode-0"]
    hits = metric(stack.http, "tandem_prefix_cache_hit_pages_total")
    misses = metric(stack.http, "tandem_prefix_cache_miss_pages_total")
    assert hits["decode-0"] > 0 and misses["decode-0"] > 0  # the same prompts came back; the first time missed


def test_operators_can_flush_every_cache(stack):
    if stack.variant == "cache-off":
        pytest.skip("nothing to flush")
    complete(stack.http, SYSTEM + TURNS[0])
    settled(stack.http)
    assert sum(metric(stack.http, "tandem_prefix_cache_pages").values()) > 0
    out = subprocess.run([sys.executable, "-m", "cli.main", "cache", "flush", "--url", stack.http],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "flushed" in out.stdout
    deadline = time.monotonic() + 10
    while sum(metric(stack.http, "tandem_prefix_cache_pages").values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sum(metric(stack.http, "tandem_prefix_cache_pages").values()) == 0
    _, use = complete(stack.http, SYSTEM + TURNS[0])
    assert use["prompt_tokens_details"]["cached_tokens"] == 0  # computed again after the flush
