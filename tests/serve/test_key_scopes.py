"""Cached prefixes per API key (`prefix_cache.per_api_key`) on a real stack: two keys, both doors. A
key's repeated prompt is served from its own cached pages; the other key's identical prompt computes
every page (so its latency says nothing of the first key's prompts); a cache_salt splits a key's scope
further and never crosses keys; the answers never change. The gRPC door scopes its calls exactly as the
HTTP door does: what a key cached over gRPC serves the same key over HTTP, and nobody else. Keys rotate
on SIGHUP without a restart (a new key starts with a cold scope of its own); a reload that would break
the keys is refused and the running keys kept."""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from engine.generate import run_generation
from frontdoor.api_keys import ApiKeyError, ApiKeys, Caller, read_keys
from tandem.sampling_params import SamplingParams
from tests.conftest import sighup, start_serve, stop_serve
from tests.serve.clients import ensemble_inputs, grpc_stream, post
from tests.serve.hold import held, in_flight

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
KEYS = f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n"  # the key file: each key with its holder's name
MAX_TOKENS = 8
# each test's prompts start with words of their own, so no test finds pages another one cached
PREAMBLE = ("you keep the harbour's tide tables and the names of every boat that ever moored at the "
            "north quay, and you answer in one short sentence, saying so when a record is missing.\n")


@pytest.fixture(scope="module")
def scoped(built_engines, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-key-scopes")
    (work / "keys").write_text(KEYS)
    (work / "dep.yaml").write_text(yaml.safe_dump({"front_door": {"api_key_file": str(work / "keys")},
                                                   "prefix_cache": {"per_api_key": True},
                                                   "limits": {"max_in_flight_per_key": 1}}))
    s = start_serve(built_engines, work, "--config", str(work / "dep.yaml"))
    s.key_file = work / "keys"
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


def test_one_holders_requests_in_flight_are_limited_and_leave_the_others_room(scoped):
    """limits.max_in_flight_per_key 1: with tenant-a's request held (its prefill worker paused), its
    next one is a 429 naming the limit, while tenant-b's is admitted beside it; both answer once freed."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # outside the hold: its exit waits for tenant-b's
        with held(scoped, headers={"Authorization": f"Bearer {KEY_A}"}) as first:
            status, body = post(scoped.http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                                headers={"Authorization": f"Bearer {KEY_A}"})
            assert status == 429 and "max_in_flight_per_key" in body["error"]["message"], body
            other = pool.submit(post, scoped.http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                                headers={"Authorization": f"Bearer {KEY_B}"})
            deadline = time.monotonic() + 60
            while in_flight(scoped) < 2:  # admitted beside tenant-a's, waiting for the paused worker too
                assert not other.done() and time.monotonic() < deadline, other.result() if other.done() else "late"
                time.sleep(0.05)
        assert first.result()[0] == 200 and other.result()[0] == 200
    status, body = post(scoped.http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 2},
                        headers={"Authorization": f"Bearer {KEY_A}"})
    assert status == 400 and "max_in_flight_per_key" in body["error"]["message"], body  # could never be admitted


def key_counters(s) -> dict[tuple[str, str], float]:
    """(prompt | output, key name) -> tokens, from the door's /metrics (open without a key)."""
    with urllib.request.urlopen(s.http + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in
            re.finditer(r'^tandem_api_key_(prompt|output)_tokens_total\{api_key="([^"]+)"\} (\S+)$', text, re.M)}


def test_each_callers_tokens_are_counted_and_logged_under_its_keys_name(scoped):
    before = key_counters(scoped)
    status, body = post(scoped.http, "/v1/completions", {"prompt": "Name a boat.", "max_tokens": 5},
                        headers={"Authorization": f"Bearer {KEY_B}", "X-Request-Id": "counted-b-1"})
    assert status == 200
    c = grpcclient.InferenceServerClient(scoped.grpc)
    try:
        out = c.infer("ensemble", ensemble_inputs(grpcclient, "Name a boat.", 4, False), request_id="counted-b-2",
                      headers={"authorization": f"Bearer {KEY_B}", "x-request-id": "counted-b-2"})
    finally:
        c.close()
    grpc_in, grpc_out = (int(np.asarray(out.as_numpy(n)).ravel()[0]) for n in ("num_input_tokens", "num_output_tokens"))
    after = key_counters(scoped)
    use = body["usage"]
    assert after[("prompt", "tenant-b")] - before.get(("prompt", "tenant-b"), 0) == use["prompt_tokens"] + grpc_in
    assert after[("output", "tenant-b")] - before.get(("output", "tenant-b"), 0) == use["completion_tokens"] + grpc_out
    assert all(after[k] == v for k, v in before.items() if k[1] != "tenant-b")  # nobody else's
    log = open(scoped.log_path).read()
    lines = [ln for ln in log.splitlines() if "counted-b-" in ln and "tandem.access" in ln]
    assert len(lines) == 2 and all("api_key=tenant-b" in ln for ln in lines), lines
    assert KEY_B not in log and KEY_A not in log


def reloaded(s, keys: str, says: str) -> None:
    """Write `keys` as the key file and reload (SIGHUP); the reload's log line says `says`."""
    s.key_file.write_text(keys)
    sighup(s, says)


def status_with(s, key: str) -> int:
    status, _ = post(s.http, "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                     headers={"Authorization": f"Bearer {key}"})
    return status


def grpc_code_with(s, key: str) -> grpc.StatusCode:
    with grpc.insecure_channel(s.grpc) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelMetadata")
        try:
            call(b"\n\x08ensemble", metadata=(("authorization", f"Bearer {key}"),), timeout=30)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def test_keys_rotate_on_sighup_and_a_broken_reload_keeps_the_running_ones(scoped, default_engine):
    """Last in this module: it rewrites the key file (and leaves it as it found it)."""
    key_c = "tenant-c-key-0123456789"
    assert status_with(scoped, key_c) == 401 and grpc_code_with(scoped, key_c) == grpc.StatusCode.UNAUTHENTICATED
    key_a2 = "tenant-a-new-key-0123456789"  # tenant-a's next key, beside its current one
    reloaded(scoped, KEYS + f"{key_c}\n{key_a2} tenant-a\n", "reloaded: 4 API keys (2 new, 0 removed)")
    assert status_with(scoped, key_c) == 200 and grpc_code_with(scoped, key_c) == grpc.StatusCode.OK
    prompt = "System: at the tide office, " + PREAMBLE + "User: When is high tide on Sunday?\nAssistant:"
    complete(scoped, KEY_A, prompt)  # tenant-a's pages of it are cached (whatever ran before)
    assert complete(scoped, key_c, prompt)[1] == 0  # key A cached it: an unnamed new key's scope starts cold
    assert complete(scoped, key_a2, prompt)[1] > 0  # tenant-a's new key shares tenant-a's scope: warm
    for broken, says in (("short\n", "at least 8 characters"), ("# every key removed\n", "no keys are configured")):
        reloaded(scoped, broken, "reload refused")
        assert says in scoped.log_tail(3)
        assert [status_with(scoped, k) for k in (KEY_A, key_c)] == [200, 200]
    reloaded(scoped, KEYS, "reloaded: 2 API keys (0 new, 2 removed)")
    assert status_with(scoped, key_c) == 401 and grpc_code_with(scoped, key_c) == grpc.StatusCode.UNAUTHENTICATED
    assert status_with(scoped, KEY_A) == 200 and grpc_code_with(scoped, KEY_B) == grpc.StatusCode.OK


def test_a_rotation_that_would_change_more_than_the_keys_is_refused():
    running = ApiKeys((b"k" * 8,), ("tenant-k",), open_probes=True, per_key_cache=True)
    for new, says in ((None, "switching them off needs a restart"),
                      (ApiKeys((b"n" * 8,), open_probes=False, per_key_cache=True), "only with a restart"),
                      (ApiKeys((b"n" * 8,), open_probes=True, per_key_cache=False), "only with a restart")):
        with pytest.raises(ApiKeyError, match=says):
            running.rotate(new)
        assert running.keys == (b"k" * 8,)
    assert running.rotate(ApiKeys((b"k" * 8, b"n" * 8), ("tenant-k", ""), open_probes=True,
                                  per_key_cache=True)) == "2 API keys (1 new, 0 removed)"
    assert running.caller("Bearer " + "k" * 8) == Caller("tenant-k", "name-tenant-k")
    unnamed = running.caller("Bearer " + "n" * 8)
    assert re.fullmatch(r"key-[0-9a-f]{8}", unnamed.name) and re.fullmatch(r"[0-9a-f]{32}", unnamed.scope)
    assert running.caller("Bearer " + "x" * 8) is None and running.caller("Basic " + "k" * 8) is None


def test_a_key_file_names_each_keys_holder_and_refuses_what_it_cannot_read(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# holders\n{KEY_A} tenant-a\n\n{KEY_B}\n{'c' * 12} tenant-a\n")
    assert read_keys(str(f), environ={}) == ((KEY_A.encode(), "tenant-a"), (KEY_B.encode(), ""),
                                            (b"c" * 12, "tenant-a"))
    assert read_keys(None, environ={"TANDEM_API_KEY": KEY_A})[0] == (KEY_A.encode(), "")
    for bad in (f"{KEY_A} two names", f"{KEY_A} bad/name", "short tenant-a"):
        f.write_text(bad + "\n")
        with pytest.raises(ApiKeyError, match="at least 8 characters") as e:
            read_keys(str(f), environ={})
        assert KEY_A not in str(e.value)  # a key never appears in a message
