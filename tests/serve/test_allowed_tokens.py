"""vLLM's `allowed_token_ids` through the official SDK on a real 1P1D stack: the answer holds only
those tokens, greedy and seeded-sampled, each exactly the engine's own answer under the same list
(prefill samples the first token, decode the rest); an empty list, an id outside the vocabulary and
a list beside structured output are 400s naming the field."""

from __future__ import annotations

import pytest

from engine.tokenizer import ChatMessage
from tandem.sampling_params import SamplingParams
from tests.conftest import complete
from tests.serve.test_door_conformance import http

MODEL = "smollm2-135m"
ASK = "Name three colours."


def test_the_answer_holds_only_the_allowed_tokens_exactly_as_one_engine(openai_client, default_engine):
    tok = default_engine.tokenizer
    allowed = sorted({*tok.encode(" red green blue yellow, and", add_special_tokens=False), *tok.encode("Red")})
    ids = tok.encode_chat([ChatMessage("user", ASK)])
    for params in (dict(temperature=0), dict(temperature=0.9, seed=11)):
        want = complete(default_engine, ids, SamplingParams(max_tokens=10, allowed_token_ids=tuple(allowed),
                                                            **params)).output_ids
        assert set(want) <= set(allowed) and len(want) == 10
        got = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                                    max_tokens=10, extra_body={"allowed_token_ids": allowed},
                                                    **params)
        assert got.choices[0].message.content == tok.decode(want), params


@pytest.mark.parametrize("extra, says", [
    ({"allowed_token_ids": []}, "one token at least"),
    ({"allowed_token_ids": [5, 10 ** 9]}, "token ids must be in"),
    ({"allowed_token_ids": [5], "response_format": {"type": "json_object"}}, "exclude each other"),
])
def test_a_bad_allowed_list_is_a_400_naming_it(served, extra, says):
    status, body, _ = http(served.http, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": ASK}], "max_tokens": 4} | extra)
    assert status == 400 and body["error"]["param"] == "allowed_token_ids" and says in body["error"]["message"], body
