"""Cached prefixes per API key (`prefix_cache.per_api_key`) on a real stack: two keys, both doors. A
key's repeated prompt is served from its own cached pages; the other key's identical prompt computes
every page (so its latency says nothing of the first key's prompts); a cache_salt splits a key's scope
further and never crosses keys; the answers never change. The gRPC door scopes its calls exactly as the
HTTP door does: what a key cached over gRPC serves the same key over HTTP, and nobody else."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from engine.generate import run_generation
from tandem.sampling_params import SamplingParams
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import ensemble_inputs, grpc_stream, post

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
MAX_TOKENS = 8
# each test's prompts start with words of their own, so no test finds pages another one cached
PREAMBLE = ("you keep the harbour's tide tables and the names of every boat that ever moored at the "
            "north quay, and you answer in one short sentence, saying so when a record is missing.\n")


@pytest.fixture(scope="module")
def scoped(built_engines, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-key-scopes")
    (work / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
    (work / "dep.yaml").write_text(yaml.safe_dump({"front_door": {"api_key_file": str(work / "keys")},
                                                   "prefix_cache": {"per_api_key": True}}))
    s = start_serve(built_engines, work, "--config", str(work / "dep.yaml"))
    yield s
    stop_serve(s)


def reference(engine, prompt: str) -> str:
    return run_generation(engine, engine.tokenizer.encode(prompt), SamplingParams(max_tokens=MAX_TOKENS)).text


def complete(s, key: str, prompt: str, **extra) -> tuple[str, int]:
    """The answer's text and its cached prompt tokens, asked with `key` over OpenAI HTTP."""
    status, body = post(s.http, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
                        | extra, headers={"Authorization": f"Bearer {key}"})
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_keys_cached_prefix_serves_that_key_alone(scoped, default_engine):
    prompt = "System: at the tide office, " + PREAMBLE + "User: When is high tide on Sunday?\nAssistant:"
    want = reference(default_engine, prompt)
    asked = [complete(scoped, key, prompt) for key in (KEY_A, KEY_A, KEY_B, KEY_B, KEY_A)]
    assert [text for text, _ in asked] == [want] * 5
    cached = [c for _, c in asked]
    assert cached[0] == 0 and cached[2] == 0, cached  # each key's first ask computes every page
    assert cached[1] > 0 and cached[3] > 0 and cached[4] > 0, cached  # its repeats take its own pages


def test_a_cache_salt_splits_a_keys_scope_and_never_crosses_keys(scoped, default_engine):
    prompt = "System: in the ledger room, " + PREAMBLE + "User: Which boat moored last?\nAssistant:"
    want = reference(default_engine, prompt)
    runs = [(KEY_A, None), (KEY_A, "ledger"), (KEY_A, "ledger"), (KEY_B, "ledger"), (KEY_B, None)]
    asked = [complete(scoped, key, prompt, **({"cache_salt": salt} if salt else {})) for key, salt in runs]
    assert [text for text, _ in asked] == [want] * 5
    cached = [c for _, c in asked]
    assert cached[:2] == [0, 0] and cached[3:] == [0, 0], cached  # each new (key, salt) pair computes it all
    assert cached[2] > 0, cached


def test_the_grpc_door_scopes_its_calls_to_their_key(scoped, default_engine):
    prompt = "System: at the quay gate, " + PREAMBLE + "User: Is the north quay open at night?\nAssistant:"
    want = reference(default_engine, prompt)
    c = grpcclient.InferenceServerClient(scoped.grpc)
    try:
        out = c.infer("ensemble", ensemble_inputs(grpcclient, prompt, MAX_TOKENS, False),
                      headers={"authorization": f"Bearer {KEY_A}"})
        assert out.as_numpy("text_output")[0][0].decode() == want
        assert int(np.asarray(out.as_numpy("num_input_tokens")).ravel()[0]) > 16  # more than one page to cache
    finally:
        c.close()
    text_b, cached_b = complete(scoped, KEY_B, prompt)
    text_a, cached_a = complete(scoped, KEY_A, prompt)
    assert text_a == text_b == want
    assert cached_b == 0 and cached_a > 0, (cached_b, cached_a)
    # the streaming call (ModelStreamInfer) too, this time key B first
    prompt = "System: at the harbour bell, " + PREAMBLE + "User: Who rings the bell?\nAssistant:"
    parts = grpc_stream(scoped.grpc, prompt, MAX_TOKENS, headers={"authorization": f"Bearer {KEY_B}"})
    assert "".join(parts) == reference(default_engine, prompt)
    (_, cached_a), (_, cached_b) = complete(scoped, KEY_A, prompt), complete(scoped, KEY_B, prompt)
    assert cached_a == 0 and cached_b > 0, (cached_a, cached_b)
