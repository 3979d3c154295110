"""vLLM's /tokenize, /detokenize and /version on a running `tandem serve`: the ids a request gets (its
usage counts them), back to the same text, and bad input refused in OpenAI's error shape."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from engine.tokenizer import ChatMessage
from tests.serve.clients import post

PROMPT = "The capital of France is"


def test_tokenize_gives_the_ids_a_request_is_counted_with(served, default_engine):
    tok = default_engine.tokenizer
    status, reply = post(served.http, "/tokenize", {"model": "smollm2-135m", "prompt": PROMPT,
                                                    "return_token_strs": True})
    assert status == 200 and reply["tokens"] == tok.encode(PROMPT) and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == 8192 and "".join(reply["token_strs"]) == PROMPT
    _, answer = post(served.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert answer["usage"]["prompt_tokens"] == reply["count"]
    msgs = [{"role": "user", "content": "Hi"}]
    status, chat = post(served.http, "/tokenize", {"messages": msgs})
    assert status == 200 and chat["tokens"] == tok.encode_chat([ChatMessage("user", "Hi")])
    _, answer = post(served.http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert answer["usage"]["prompt_tokens"] == chat["count"]


def test_tokenizer_info_and_the_options_an_evaluation_harness_sends(served, default_engine):
    """lm-evaluation-harness uses a server's tokenizer when GET /tokenizer_info answers with an eos_token and
    /tokenize takes {"add_special_tokens": false}; it renders chat templates itself from chat_template."""
    tok = default_engine.tokenizer
    with urllib.request.urlopen(served.http + "/tokenizer_info", timeout=30) as r:
        info = json.loads(r.read())
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == 8192
    status, reply = post(served.http, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200 and reply["tokens"] == tok.encode(PROMPT, add_special_tokens=False)
    msgs = [{"role": "user", "content": "Hi"}]
    _, bare = post(served.http, "/tokenize", {"messages": msgs, "add_generation_prompt": False})
    _, full = post(served.http, "/tokenize", {"messages": msgs})
    assert full["tokens"][:bare["count"]] == bare["tokens"] and full["count"] > bare["count"]


def test_detokenize_gives_the_text_back_with_special_tokens(served, default_engine):
    ids = default_engine.tokenizer.encode_chat([ChatMessage("user", "Hi")])
    status, reply = post(served.http, "/detokenize", {"tokens": ids})
    assert status == 200 and reply["prompt"] == default_engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in reply["prompt"]


def test_version_and_the_model_card_say_what_clients_budget_with(served):
    with urllib.request.urlopen(served.http + "/version", timeout=30) as r:
        version = json.loads(r.read())
    cli = subprocess.run([sys.executable, "-m", "cli.main", "--version"], capture_output=True, text=True, check=True)
    assert cli.stdout.startswith(f"tandem, version {version['version']} (wire schema {version['wire']}:")
    with urllib.request.urlopen(served.http + "/v1/models", timeout=30) as r:
        assert json.loads(r.read())["data"][0]["max_model_len"] == 8192


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("/tokenize", {"prompt": "x" * ((1 << 20) + 1)}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, None),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [99999999]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
])
def test_bad_input_is_refused_in_openais_shape(served, path, body, status, param):
    got, reply = post(served.http, path, body)
    assert got == status and reply["error"]["param"] == param and reply["error"]["message"], reply
