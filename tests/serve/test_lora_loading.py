"""LoRA adapters loaded and unloaded while a real 1P1D stack serves (`tandem serve --lora-root DIR`,
vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter): a loaded adapter is listed and answers
with PEFT's own greedy tokens across the handoff, on the OpenAI and Triton doors; loading a name again in
place serves the new adapter and never the pages its predecessor cached; an unloaded adapter is refused
at once but finishes the request that named it, and only then leaves the workers; a worker restarted
after a load is given the adapter before it serves; bad loads are refused naming the problem, and
change nothing; the number of adapters held is bounded.

The tests run in order over one stack: each says what it leaves loaded."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from engine.tokenizer import ChatMessage, Tokenizer
from tests.conftest import start_serve, stop_serve
from tests.engine.test_exactness import LONG_TEXT, hf_greedy
from tests.engine.test_lora import TARGETS, make_adapter
from tests.serve.clients import grpc_stream, post

pytest.importorskip("peft")
ASK = "What is the capital of France?"
MAX_TOKENS = 16
MAX_ADAPTERS = 4


def test_the_routes_are_off_unless_a_folder_is_given(served):
    """The shared stack has no --lora-root: both routes answer 404 saying how to turn them on."""
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, body = post(served.http, path, {"lora_name": "x", "lora_path": "/tmp"})
        assert status == 404 and "--lora-root" in body["error"]["message"], body


@pytest.fixture(scope="module")
def folders(hf_default_model, tmp_path_factory):
    """Adapters in the loading root (a1, a2: random, every projection; damaged: a1 with its weights cut
    short; r4: a1 claiming another rank; link: a link out of the root) and one outside it (start, given
    at start). Their PEFT models are the references."""
    hf = hf_default_model[1]
    base = tmp_path_factory.mktemp("lora-loading")
    root = base / "root"
    root.mkdir()
    refs = {name: make_adapter(hf, str(root / name), TARGETS, seed) for name, seed in (("a1", 8), ("a2", 19))}
    refs["start"] = make_adapter(hf, str(base / "start"), TARGETS, 1)
    shutil.copytree(root / "a1", root / "damaged")
    weights = root / "damaged" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])  # the header is whole: only a worker's load sees it
    shutil.copytree(root / "a1", root / "r4")
    conf = json.loads((root / "r4" / "adapter_config.json").read_text())
    (root / "r4" / "adapter_config.json").write_text(json.dumps(conf | {"r": 4}))
    os.symlink(base / "start", root / "link")
    return base, root, refs


@pytest.fixture(scope="module")
def stack(served, built_engines, folders, tmp_path_factory):
    base, root, _ = folders
    work = tmp_path_factory.mktemp("serve-lora-loading")
    config = work / "deployment.yaml"
    config.write_text(yaml.safe_dump({"lora_modules": {"start": str(base / "start")},
                                      "lora_loading": {"root": str(root), "max_adapters": MAX_ADAPTERS}}))
    s = start_serve(built_engines, work / "serve", "--config", str(config))
    yield s
    stop_serve(s)


@pytest.fixture(scope="module")
def want(folders, hf_default_model, built_engines) -> dict[str, str]:
    """PEFT's greedy chat answer to ASK for each adapter, and the base model's."""
    tok = Tokenizer(str(built_engines / "prefill"))
    ids = tok.encode_chat([ChatMessage("user", ASK)])
    models = {**folders[2], "base": hf_default_model[1]}
    return {name: tok.decode(hf_greedy(model, ids, MAX_TOKENS, eos=2)) for name, model in models.items()}


def call(url: str, path: str, body: dict) -> tuple[int, str]:
    """POST JSON; (status, the body's text) whatever the status."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def chat(url: str, model: str) -> str:
    status, got = post(url, "/v1/chat/completions", {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "messages": [{"role": "user", "content": ASK}]})
    assert status == 200 and got["model"] == model, got
    return got["choices"][0]["message"]["content"]


def listed(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return {m["id"] for m in json.loads(r.read())["data"]}


def held(url: str) -> dict[str, float]:
    """tandem_worker_lora_adapters per worker, from the front door's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^tandem_worker_lora_adapters\{role="\w+",worker="([\w-]+)"\} ([\d.e+]+)', text, re.M)}


def until_held(url: str, n: int, timeout_s: float = 30.0) -> None:
    """Wait until every worker says it holds `n` adapters (their stats come on every change)."""
    deadline = time.monotonic() + timeout_s
    while set((now := held(url)).values()) != {n}:
        assert time.monotonic() < deadline, now
        time.sleep(0.2)


def test_a_loaded_adapter_is_listed_and_answers_as_pefts(stack, want):
    """Leaves `fresh` (a1) loaded."""
    until_held(stack.http, 1)  # `start`, given at start
    assert call(stack.http, "/v1/load_lora_adapter", {"lora_name": "fresh", "lora_path": "a1"}) == \
        (200, "Success: LoRA adapter 'fresh' added successfully.")
    assert listed(stack.http) >= {"fresh", "start"}
    until_held(stack.http, 2)
    with urllib.request.urlopen(stack.http + "/metrics", timeout=30) as r:  # what an endpoint picker reads
        info = re.search(r'^vllm:lora_requests_info\{(.*)\} ', r.read().decode(), re.M).group(1)
    assert f'max_lora="{MAX_ADAPTERS}"' in info and 'running_lora_adapters="start,fresh"' in info, info
    assert len({want[n] for n in ("a1", "a2", "start", "base")}) == 4  # each adapter its own answer
    for name, ref in (("fresh", "a1"), ("start", "start"), ("smollm2-135m", "base")):
        assert chat(stack.http, name) == want[ref], name
    status, got = post(stack.http, "/v1/completions", {"model": "fresh", "prompt": "The capital of France is",
                                                       "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, got
    lora = {"lora_name": (np.array([[b"fresh"]], dtype=np.object_), "BYTES")}
    assert "".join(grpc_stream(stack.grpc, "The capital of France is", MAX_TOKENS, lora)) == \
        got["choices"][0]["text"]


def test_loading_in_place_never_serves_the_predecessors_cache(stack, want):
    """`fresh` becomes a2; a1 leaves the workers (no request holds it). Leaves `fresh` (a2) loaded."""
    def complete() -> tuple[str, int]:
        status, got = post(stack.http, "/v1/completions", {"model": "fresh", "prompt": LONG_TEXT, "max_tokens": 8,
                                                           "temperature": 0})
        assert status == 200, got
        return got["choices"][0]["text"], got["usage"]["prompt_tokens_details"]["cached_tokens"]

    old, _ = complete()
    again, cached = complete()
    assert again == old and cached > 0  # a1's pages are cached
    status, text = call(stack.http, "/v1/load_lora_adapter", {"lora_name": "fresh", "lora_path": "a2",
                                                              "load_inplace": True})
    assert (status, text) == (200, "Success: LoRA adapter 'fresh' added successfully.")
    assert complete()[1] == 0  # a2 computes the prompt itself: none of a1's pages serve it
    assert chat(stack.http, "fresh") == want["a2"]
    until_held(stack.http, 2)  # start and a2: a1 is gone from every worker


def test_an_unloaded_adapter_finishes_the_request_that_named_it(stack):
    """`brief` (a1) is unloaded while a stream naming it runs: refused at once for new requests, kept on
    the workers until the stream ends, which ends as it would have. Leaves `fresh` (a2) loaded."""
    assert call(stack.http, "/v1/load_lora_adapter", {"lora_name": "brief", "lora_path": "a1"})[0] == 200
    body = {"model": "brief", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    status, whole = post(stack.http, "/v1/completions", body)
    assert status == 200, whole
    seen = {}

    def unload_at(events: int) -> None:
        if events == 3:
            seen["unload"] = call(stack.http, "/v1/unload_lora_adapter", {"lora_name": "brief"})
            seen["after"] = post(stack.http, "/v1/completions", {**body, "max_tokens": 2})
            seen["held"] = held(stack.http)

    status, events = post(stack.http, "/v1/completions", {**body, "stream": True}, on_event=unload_at)
    assert status == 200 and seen["unload"] == (200, "Success: LoRA adapter 'brief' removed successfully.")
    assert seen["after"][0] == 404 and "brief" in seen["after"][1]["error"]["message"], seen["after"]
    assert set(seen["held"].values()) == {3}  # start, fresh and brief: the stream still holds brief
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    assert "brief" not in listed(stack.http)
    until_held(stack.http, 2)  # the stream ended: brief left the workers


def test_a_restarted_worker_is_given_the_loaded_adapter_before_it_serves(stack, want):
    """Both workers are killed; their replacements start holding only `start`, and are sent `fresh` before
    they are routed to. Leaves `fresh` (a2) loaded."""
    before = stack.workers()
    for w in before.values():
        os.killpg(w["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 180
    while any(stack.workers()[n]["pid"] == w["pid"] for n, w in before.items()):
        assert time.monotonic() < deadline, stack.log_tail()
        time.sleep(0.5)
    assert chat(stack.http, "fresh") == want["a2"]  # waits for the replacements (its deadline is 600 s)
    until_held(stack.http, 2)


ROWS = [  # (path, body, status, param, words in the message)
    ("/v1/load_lora_adapter", {"lora_path": "a1"}, 400, "lora_name", "lora_name must be"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path", "lora_path must be"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../start"}, 400, "lora_path", "outside"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, 400, "lora_path", "outside"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "link"}, 400, "lora_path", "outside"),
    ("/v1/load_lora_adapter", {"lora_name": "bad name", "lora_path": "a1"}, 400, "lora_name", "must be 1-128"),
    ("/v1/load_lora_adapter", {"lora_name": "smollm2-135m", "lora_path": "a1"}, 400, "lora_name", "served under"),
    ("/v1/load_lora_adapter", {"lora_name": "start", "lora_path": "a1"}, 400, "lora_name", "already loaded"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "missing"}, 400, "lora_path", "cannot read"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "r4"}, 400, "lora_path", "needs lora_A [4, "),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "damaged"}, 400, "lora_path",
     "-0: LoRA adapter 'x': "),  # a worker's load failed: the one that did not is sent the set without it
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "a1", "extra": 1}, 400, "extra", "unknown fields"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "a1", "load_inplace": "yes"}, 400, "load_inplace",
     "true or false"),
    ("/v1/unload_lora_adapter", {"lora_name": "never"}, 404, "lora_name", "is not loaded"),
    ("/v1/unload_lora_adapter", {"lora_name": 7}, 400, "lora_name", "lora_name must be"),
]


def test_bad_loads_are_refused_naming_the_problem_and_change_nothing(stack):
    """Leaves `fresh` (a2) loaded, and nothing else."""
    for path, body, status, param, says in ROWS:
        got_status, text = call(stack.http, path, body)
        error = json.loads(text)["error"]
        assert (got_status, error["param"]) == (status, param) and says in error["message"], (body, text)
    assert call(stack.http, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "a1"})[0] == 200  # x is free
    assert call(stack.http, "/v1/unload_lora_adapter", {"lora_name": "x"})[0] == 200
    assert {"x", "never"}.isdisjoint(listed(stack.http))
    until_held(stack.http, 2)  # the damaged load was taken back from the worker that took it, if one did


def test_the_server_holds_at_most_max_adapters(stack):
    """start and fresh are held; two more fit (lora_loading.max_adapters 4), a fifth is a 429 until one goes."""
    for name in ("m1", "m2"):
        assert call(stack.http, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": "a1"})[0] == 200
    status, text = call(stack.http, "/v1/load_lora_adapter", {"lora_name": "m3", "lora_path": "a1"})
    assert status == 429 and "max_adapters" in json.loads(text)["error"]["message"], text
    assert call(stack.http, "/v1/unload_lora_adapter", {"lora_name": "m1"})[0] == 200
    assert call(stack.http, "/v1/load_lora_adapter", {"lora_name": "m3", "lora_path": "a1"})[0] == 200
    for name in ("m2", "m3"):
        assert call(stack.http, "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200
    until_held(stack.http, 2)


def test_a_missing_root_stops_the_start_in_one_line(built_engines, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cli.main", "serve", "--model", str(built_engines),
                           "--workdir", str(tmp_path), "--http-port", "0", "--grpc-port", "0",
                           "--lora-root", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "lora_loading.root" in proc.stderr and "no such folder" in proc.stderr, \
        proc.stderr[-2000:]
    assert "worker(s)" not in proc.stderr
