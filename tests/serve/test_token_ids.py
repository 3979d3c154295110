"""vLLM's token-id options on a real 1P1D stack. `return_token_ids`: the prompt's ids and the answer's
(every generated token), whole and streamed (each chunk its own, the prompt's on a choice's first chunk),
on completions' choices and at the top of a chat reply, equal to the tokenizer's and the engine's.
`return_tokens_as_token_ids`: logprobs name each token "token_id:<id>" (completions' text_offset still
counts the text)."""

from __future__ import annotations

import pytest

from engine.tokenizer import ChatMessage
from tandem.sampling_params import SamplingParams
from tests.conftest import complete
from tests.serve.clients import post
from tests.serve.test_door_conformance import http

MODEL = "smollm2-135m"
PROMPT = "The keeper of the lighthouse wrote in his log every night:"
ASK = "Name a large city."


def _engine_ids(engine, ids: list[int], n: int) -> list[int]:
    return complete(engine, ids, SamplingParams(max_tokens=n)).output_ids


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_return_token_ids_gives_the_prompts_and_the_answers_ids(served, default_engine, chat):
    tok = default_engine.tokenizer
    if chat:
        path, body, ids = ("/v1/chat/completions", {"messages": [{"role": "user", "content": ASK}]},
                           tok.encode_chat([ChatMessage("user", ASK)]))
    else:
        path, body, ids = "/v1/completions", {"prompt": PROMPT}, tok.encode(PROMPT)
    want = _engine_ids(default_engine, ids, 10)
    body |= {"model": MODEL, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    status, reply, _ = http(served.http, path, body)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert (reply if chat else choice)["prompt_token_ids"] == ids and choice["token_ids"] == want
    status, events = post(served.http, path, body | {"stream": True})
    chunks = [e for e in events if e["choices"]]
    assert status == 200 and chunks
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == len(want)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
    firsts = [c if chat else c["choices"][0] for c in chunks]
    assert firsts[0]["prompt_token_ids"] == ids and not any("prompt_token_ids" in f for f in firsts[1:])
    status, plain, _ = http(served.http, path, body | {"return_token_ids": False})
    assert status == 200 and "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(served, default_engine):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    status, named, _ = http(served.http, "/v1/completions", body)
    status2, by_id, _ = http(served.http, "/v1/completions", body | {"return_tokens_as_token_ids": True,
                                                                     "return_token_ids": True})
    assert status == status2 == 200
    got, plain = by_id["choices"][0]["logprobs"], named["choices"][0]["logprobs"]
    ids = by_id["choices"][0]["token_ids"]
    assert got["tokens"] == [f"token_id:{t}" for t in ids] and plain["tokens"] != got["tokens"]
    assert got["token_logprobs"] == plain["token_logprobs"] and got["text_offset"] == plain["text_offset"]
    assert all(k.startswith("token_id:") for top in got["top_logprobs"] for k in top)
    status, chat, _ = http(served.http, "/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": 4,
                            "temperature": 0, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True,
                            "return_token_ids": True})
    assert status == 200, chat
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert all(a["token"].startswith("token_id:") for c in content for a in c["top_logprobs"])


@pytest.mark.parametrize("field", ["return_token_ids", "return_tokens_as_token_ids"])
def test_a_token_id_option_that_is_not_a_boolean_is_a_400(served, field):
    status, reply, _ = http(served.http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, field: "yes"})
    assert status == 400 and reply["error"]["param"] == field
