"""The model's sampling defaults (generation_config.json, frontdoor/generation_defaults.py): which of the
file's fields are read, as vLLM reads them, and which refused at start; and on a real 1P1D stack, that
every OpenAI door (completions, chat, Responses) answers a request that leaves them out exactly as one
that sends them, while a request's own value wins; `auto` reads the engines' own file. Overrides
(`--override-generation-config`) go on top."""

from __future__ import annotations

import json
import os
import re

import pytest

from frontdoor.generation_defaults import FILE, GenerationConfigError, sampling_defaults
from tests.conftest import start_serve, stop_serve
from tests.serve.test_door_conformance import http

MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "Write a list of fruits."}]
# greedy, a strong repetition penalty and short answers: what the requests below leave out
CONFIG = {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 6, "top_k": 50, "do_sample": True,
          "bos_token_id": 1, "eos_token_id": 2}


def _write(folder, data) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, FILE)
    with open(path, "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data))
    return path


def test_the_fields_vllm_reads_are_read_and_transformers_defaults_skipped(tmp_path):
    engines = tmp_path / "engines"
    path = _write(engines / "prefill", {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "min_p": 0.05,
                                        "repetition_penalty": 1.0, "max_new_tokens": 7, "do_sample": False})
    want = {"temperature": 0.6, "top_p": 0.9, "min_p": 0.05, "max_tokens": 7}  # top_k 50, rp 1.0: transformers'
    assert sampling_defaults("auto", str(engines)) == want
    assert sampling_defaults(path, "elsewhere") == sampling_defaults(str(engines / "prefill"), "elsewhere") == want
    assert sampling_defaults("none", str(engines)) == {}
    assert sampling_defaults("auto", str(tmp_path / "no-engines")) == {}  # a GGUF's engines: none


@pytest.mark.parametrize("data, says", [
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"max_new_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temperature": "warm"}, "temperature"),
    ("[1, 2]", "not a JSON object"),
    ("{not json", "the generation config: cannot read"),
])
def test_a_value_no_request_could_have_is_refused_naming_it(tmp_path, data, says):
    path = _write(tmp_path, data)
    with pytest.raises(GenerationConfigError, match=re.escape(says)) as e:
        sampling_defaults(path, "unused")
    assert path in str(e.value)


def test_overrides_go_on_top_and_are_never_skipped(tmp_path):
    engines = tmp_path / "engines"
    _write(engines / "prefill", {"temperature": 0.6, "top_p": 0.9})
    got = sampling_defaults("auto", str(engines), {"temperature": 1.0, "max_new_tokens": 5})
    assert got == {"temperature": 1.0, "top_p": 0.9, "max_tokens": 5}  # 1.0 undoes the model's 0.6
    assert sampling_defaults("none", str(engines), {"top_k": 50}) == {"top_k": 50}
    with pytest.raises(GenerationConfigError, match=r"unknown field\(s\) \['max_tokens'\]; allowed: temperature"):
        sampling_defaults("none", str(engines), {"max_tokens": 5})  # the file's names: max_new_tokens
    with pytest.raises(GenerationConfigError, match="override_generation_config: top_p must be in"):
        sampling_defaults("auto", str(engines), {"top_p": 2})


def test_a_path_that_holds_no_config_is_refused(tmp_path):
    with pytest.raises(GenerationConfigError, match="no such file, nor a folder holding generation_config.json"):
        sampling_defaults(str(tmp_path / "missing"), "unused")
    with pytest.raises(GenerationConfigError, match="nor a folder"):
        sampling_defaults(str(tmp_path), "unused")  # a folder without the file


@pytest.fixture(scope="module")
def defaulted(built_engines, tmp_path_factory):
    """A stack whose engines folder is the built one plus a generation_config.json (read by `auto`)."""
    engines = tmp_path_factory.mktemp("engines-with-config")
    for role in ("prefill", "decode"):
        os.makedirs(engines / role)
        for name in os.listdir(built_engines / role):
            os.symlink(built_engines / role / name, engines / role / name)
    _write(engines / "prefill", CONFIG)
    s = start_serve(engines, tmp_path_factory.mktemp("serve-defaulted"))
    yield s
    stop_serve(s)


def _post(serve, path: str, body: dict) -> dict:
    status, reply, _ = http(serve.http, path, {"model": MODEL} | body)
    assert status == 200, reply
    return reply


def test_a_request_that_leaves_the_fields_out_gets_the_models_defaults(defaulted):
    assert "sampling defaults from the model's generation config" in defaulted.log_tail(400)
    sent = {"temperature": 0, "repetition_penalty": 1.3}
    chat = _post(defaulted, "/v1/chat/completions", {"messages": MESSAGES})
    want = _post(defaulted, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, **sent})
    assert chat["choices"][0]["message"] == want["choices"][0]["message"]
    assert chat["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 6  # max_new_tokens
    own = _post(defaulted, "/v1/chat/completions", {"messages": MESSAGES, "repetition_penalty": 1.0})
    plain = _post(defaulted, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                                                      "repetition_penalty": 1.0})
    assert own["choices"][0]["message"] == plain["choices"][0]["message"]  # the request's own value wins ...
    assert own["choices"][0]["message"] != want["choices"][0]["message"]  # ... over the default, which differs
    response = _post(defaulted, "/v1/responses", {"input": MESSAGES[0]["content"]})
    assert response["output"][0]["content"][0]["text"] == want["choices"][0]["message"]["content"]
    prompt = "Fruits: apple, banana,"
    text = _post(defaulted, "/v1/completions", {"prompt": prompt})  # completions keep max_tokens 16
    assert text["choices"][0] == _post(defaulted, "/v1/completions", {"prompt": prompt, "max_tokens": 16,
                                                                       **sent})["choices"][0]
