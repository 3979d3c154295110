"""A user's own Hugging Face folder, served in bf16: the test writes one from the default model's
weights (transformers' load of the GGUF, saved with save_pretrained in bfloat16, with its tokenizer
files), then `tandem serve --model DIR --dtype bfloat16` builds bf16 engines from it and answers as the
engine itself does in bf16 (bf16 greedy may differ from fp32, so the reference is the bf16 engine)."""

from __future__ import annotations

import copy
import json
import urllib.request

import pytest
import torch
import yaml

from engine.generate import run_generation
from engine.load import load_engine
from engine.tokenizer import ChatMessage
from tandem.sampling_params import SamplingParams
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import post

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def folder(hf_default_model, tmp_path_factory):
    """`my-smollm2/`: config.json (torch_dtype bfloat16), model.safetensors, the tokenizer's files."""
    import transformers

    tok, model = hf_default_model
    out = tmp_path_factory.mktemp("hf") / "my-smollm2"
    config = copy.deepcopy(model.config)  # a plain checkpoint: not marked as loaded from a GGUF
    del config.quantization_config
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict())
    plain.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def own(folder, tmp_path_factory):
    """The folder served with --dtype bfloat16; engines are built into the test's folder (the deployment
    file's `engines:`), not ./engines."""
    work = tmp_path_factory.mktemp("serve-own")
    cfg = work / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"engines": str(work / "engines")}))
    s = start_serve(folder, work, "--dtype", "bfloat16", "--config", str(cfg))
    yield s, work / "engines"
    stop_serve(s)


@pytest.fixture(scope="module")
def bf16_engine(folder):
    return load_engine(str(folder), dtype="bfloat16", kv_bytes=64 << 20)


def test_the_folder_is_a_bf16_hugging_face_checkpoint(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}


def test_engines_are_built_in_bf16_from_the_folder(own, folder):
    _, engines = own
    for role in ("prefill", "decode"):
        manifest = json.loads((engines / role / "manifest.json").read_text())
        assert manifest["dtype"] == "bfloat16" and manifest["source"] == str(folder)
    from safetensors import safe_open

    with safe_open(str(engines / "decode" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_completion_and_chat_equal_the_bf16_engine_and_name_paris(own, bf16_engine):
    s, _ = own
    with urllib.request.urlopen(s.http + "/v1/models", timeout=30) as r:
        assert [m["id"] for m in json.load(r)["data"]] == ["my-smollm2"]  # the folder's name
    want = run_generation(bf16_engine, bf16_engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=8)).text
    status, body = post(s.http, "/v1/completions", {"model": "my-smollm2", "prompt": PROMPT, "max_tokens": 8,
                                                    "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == want and "Paris" in want
    ids = bf16_engine.tokenizer.encode_chat([ChatMessage("user", QUESTION)])
    want = run_generation(bf16_engine, ids, SamplingParams(max_tokens=16)).text
    status, body = post(s.http, "/v1/chat/completions", {"model": "my-smollm2", "max_tokens": 16, "temperature": 0,
                                                         "messages": [{"role": "user", "content": QUESTION}]})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == want and "Paris" in want
