"""LoRA adapters served by a real 1P1D stack (`tandem serve --lora-modules NAME=PATH`): a request whose
model is the adapter's name is answered, across the prefill/decode handoff, with the tokens PEFT's own
model gives (greedy), and the answer carries the adapter's name; Triton clients name it in the
`lora_name` input; the base model's answers are unchanged; the adapter is listed as vLLM lists it;
cached prefixes of the base model never serve the adapter's requests; a bad adapter stops the start in
one line, before any worker starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from engine.tokenizer import ChatMessage, Tokenizer
from tests.conftest import start_serve, stop_serve
from tests.engine.test_exactness import LONG_TEXT, hf_greedy
from tests.engine.test_lora import TARGETS, make_adapter
from tests.serve.clients import ensemble_inputs, grpc_stream, post

pytest.importorskip("peft")
ASK = "What is the capital of France?"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapter(hf_default_model, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("lora") / "every")
    return folder, make_adapter(hf_default_model[1], folder, TARGETS, 1)


@pytest.fixture(scope="module")
def lora_served(built_engines, adapter, tmp_path_factory):
    s = start_serve(built_engines, tmp_path_factory.mktemp("serve-lora"), "--lora-modules", f"every={adapter[0]}")
    yield s
    stop_serve(s)


def chat(url: str, model: str) -> dict:
    status, got = post(url, "/v1/chat/completions", {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                     "messages": [{"role": "user", "content": ASK}]})
    assert status == 200, got
    return got


def test_the_adapters_answer_is_pefts_and_carries_its_name(lora_served, adapter, hf_default_model, built_engines):
    tok = Tokenizer(str(built_engines / "prefill"))
    ids = tok.encode_chat([ChatMessage("user", ASK)])
    want = {name: tok.decode(hf_greedy(model, ids, MAX_TOKENS, eos=2)) for name, model in
            (("every", adapter[1]), ("smollm2-135m", hf_default_model[1]))}
    assert want["every"] != want["smollm2-135m"]  # the adapter changes the answer
    for name in want:
        got = chat(lora_served.http, name)
        assert got["model"] == name and got["choices"][0]["message"]["content"] == want[name], name


def test_triton_clients_name_the_adapter_in_lora_name(lora_served, built_engines):
    """gRPC (unary and streamed) and KServe HTTP: the `lora_name` input gives the completion the OpenAI
    door gives for the adapter's model name; without it, the base model's (the prompt: the chat's text)."""
    prompt = Tokenizer(str(built_engines / "prefill")).render_chat([ChatMessage("user", ASK)])

    def complete(model: str) -> str:
        status, got = post(lora_served.http, "/v1/completions", {"model": model, "prompt": prompt,
                                                                 "max_tokens": MAX_TOKENS, "temperature": 0})
        assert status == 200, got
        return got["choices"][0]["text"]

    lora = {"lora_name": (np.array([[b"every"]], dtype=np.object_), "BYTES")}
    want, base = complete("every"), complete("smollm2-135m")
    assert want != base
    for module, url in ((grpcclient, lora_served.grpc), (httpclient, lora_served.http.removeprefix("http://"))):
        c = module.InferenceServerClient(url)
        try:
            for extra, answer in ((lora, want), ({}, base)):
                got = c.infer("ensemble", ensemble_inputs(module, prompt, MAX_TOKENS, False, extra))
                assert got.as_numpy("text_output")[0][0].decode() == answer, (module.__name__, extra)
        finally:
            c.close()
    assert "".join(grpc_stream(lora_served.grpc, prompt, MAX_TOKENS, lora)) == want


def test_the_adapter_is_listed_with_its_parent(lora_served):
    with urllib.request.urlopen(lora_served.http + "/v1/models", timeout=30) as r:
        models = json.loads(r.read())
    cards = {m["id"]: m for m in models["data"]}
    assert cards["every"]["parent"] == "smollm2-135m" and "parent" not in cards["smollm2-135m"]
    status, unknown = post(lora_served.http, "/v1/completions", {"model": "other", "prompt": "Hi", "max_tokens": 2})
    assert status == 404 and "every" in unknown["error"]["message"], unknown


def test_the_base_models_cached_prefix_never_serves_the_adapter(lora_served):
    def complete(model: str) -> tuple[str, int]:
        status, got = post(lora_served.http, "/v1/completions", {"model": model, "prompt": LONG_TEXT,
                                                                 "max_tokens": 8, "temperature": 0})
        assert status == 200, got
        return got["choices"][0]["text"], got["usage"]["prompt_tokens_details"]["cached_tokens"]

    base, _ = complete("smollm2-135m")
    again, cached = complete("smollm2-135m")
    assert again == base and cached > 0  # the base model's pages are cached ...
    first, cached = complete("every")  # ... and not the adapter's
    assert cached == 0
    again, cached = complete("every")  # its own pages are cached, and give the same answer
    assert again == first and cached > 0


@pytest.mark.parametrize("flag, says", [
    ("bad name=/tmp", "LoRA adapter name 'bad name'"),
    ("nothing", "NAME=PATH is needed"),
    ("sql=/nonexistent/adapter", "LoRA adapter 'sql': cannot read /nonexistent/adapter/adapter_config.json"),
])
def test_a_bad_adapter_stops_the_start_in_one_line(built_engines, tmp_path, flag, says):
    proc = subprocess.run([sys.executable, "-m", "cli.main", "serve", "--model", str(built_engines),
                           "--workdir", str(tmp_path), "--http-port", "0", "--grpc-port", "0", "--lora-modules", flag],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and says in proc.stderr, proc.stderr[-2000:]
    assert "worker(s)" not in proc.stderr  # refused before any worker starts


def test_an_adapter_of_another_model_stops_the_start_naming_the_shapes(built_engines, adapter, tmp_path):
    folder = tmp_path / "other"
    shutil.copytree(adapter[0], folder)
    conf = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(conf | {"r": 4}))
    proc = subprocess.run([sys.executable, "-m", "cli.main", "serve", "--model", str(built_engines),
                           "--workdir", str(tmp_path / "w"), "--http-port", "0", "--grpc-port", "0",
                           "--lora-modules", f"other={folder}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "LoRA adapter 'other': layer 0" in proc.stderr, proc.stderr[-2000:]
    assert "needs lora_A [4, " in proc.stderr and "worker(s)" not in proc.stderr


def test_the_bench_drivers_name_the_adapter(lora_served):
    """`tandem bench --lora-modules`: both drivers send a request's model (gRPC as `lora_name`, OpenAI as
    `model`); the adapter's name is served, another is the server's 404 / NOT_FOUND, recorded as the
    request's error."""
    import asyncio

    from clients.bench.bench_workload import RequestSpec
    from clients.bench.drivers import make_driver

    async def send(protocol: str, url: str, model: str):
        driver = make_driver(protocol, url)
        try:
            return await driver.send(RequestSpec("s", 0, "The capital of France is", 4, None, model=model), 0.0)
        finally:
            await driver.close()

    for protocol, url in (("grpc", lora_served.grpc), ("openai", lora_served.http)):
        served = asyncio.run(send(protocol, url, "every"))
        assert served.error is None and served.output_tokens == 4, (protocol, served)
        missing = asyncio.run(send(protocol, url, "nope"))
        assert "nope" in (missing.error or "") and ("404" in missing.error or "NOT_FOUND" in missing.error), \
            (protocol, missing.error)
