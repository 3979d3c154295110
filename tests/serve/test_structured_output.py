"""Structured output on a real 1P1D stack: OpenAI's `response_format` and vLLM's guided fields through
the official SDK, and TensorRT-LLM's `guided_decoding_guide_type` / `guided_decoding_guide` inputs
through KServe v2 HTTP and Triton gRPC. Prefill samples the first token under the grammar and decode
the rest, so each answer must equal one engine's own, token for token, streamed or not."""

from __future__ import annotations

import json
import re

import pytest

from engine.tokenizer import ChatMessage
from tandem.guides import Guide, GuideKind
from tandem.sampling_params import SamplingParams
from tests.conftest import complete
from tests.serve.test_door_conformance import grpc_request, grpc_stream, grpc_unary, http, kserve_json, output

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
QUESTION = "Name a city in France and its population."
PROMPT = "The largest city in France is"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                          "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
          "required": ["city", "population"], "additionalProperties": False}


def _engine_text(engine, ids, guide: Guide, **params) -> str:
    return engine.tokenizer.decode(complete(engine, ids, SamplingParams(guide=guide, **params)).output_ids)


def test_a_json_schema_chat_answer_is_the_engines_own_streamed_and_not(openai_client, default_engine):
    ids = default_engine.tokenizer.encode_chat([ChatMessage("user", QUESTION)])
    want = _engine_text(default_engine, ids, Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA)), max_tokens=40,
                        temperature=0.7, seed=5)
    assert set(json.loads(want)) == {"city", "population"}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=40, temperature=0.7, seed=5,
              response_format=fmt)
    got = openai_client.chat.completions.create(**kw)
    assert got.choices[0].message.content == want and got.choices[0].finish_reason == "stop"
    chunks = openai_client.chat.completions.create(stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_json_mode_answers_an_object(openai_client, default_engine):
    ids = default_engine.tokenizer.encode_chat([ChatMessage("user", QUESTION)])
    want = _engine_text(default_engine, ids, Guide(GuideKind.JSON_SCHEMA, '{"type": "object"}'), max_tokens=60)
    got = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert got.choices[0].message.content == want and want.startswith("{")


@pytest.mark.parametrize("extra, guide, holds", [
    ({"guided_regex": r"[A-Z][a-z]+, [0-9]{4}"}, Guide(GuideKind.REGEX, r"[A-Z][a-z]+, [0-9]{4}"),
     lambda t: re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", t)),
    ({"guided_choice": ["Paris", "Lyon", "Nice"]}, Guide(GuideKind.CHOICE, '["Paris", "Lyon", "Nice"]'),
     lambda t: t in ("Paris", "Lyon", "Nice")),
    ({"guided_grammar": 'root ::= " " ("Paris" | "Lyon")'}, Guide(GuideKind.EBNF_GRAMMAR, 'root ::= " " ("Paris" | "Lyon")'),
     lambda t: t in (" Paris", " Lyon")),
    ({"structured_outputs": {"choice": ["Marseille", "Toulouse"]}}, Guide(GuideKind.CHOICE, '["Marseille", "Toulouse"]'),
     lambda t: t in ("Marseille", "Toulouse")),
], ids=["guided_regex", "guided_choice", "guided_grammar", "structured_outputs"])
def test_vllms_guided_fields_on_completions(openai_client, default_engine, extra, guide, holds):
    want = _engine_text(default_engine, default_engine.tokenizer.encode(PROMPT), guide, max_tokens=16,
                        temperature=1.0, seed=3)
    for stream in (False, True):
        got = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3,
                                               stream=stream, extra_body=extra)
        text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert text == want and holds(text), (text, want)


def test_every_door_gives_the_same_guided_tokens(served, default_engine):
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA))
    want = _engine_text(default_engine, default_engine.tokenizer.encode(PROMPT), guide, max_tokens=30)
    status, body, _ = http(served.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 30, "temperature": 0,
                                                            "guided_json": SCHEMA})
    assert status == 200 and body["choices"][0]["text"] == want, body
    tensors = {"text_input": ([PROMPT], "BYTES"), "max_tokens": ([30], "INT32"), "exclude_input_in_output": ([True], "BOOL"),
               "guided_decoding_guide_type": (["json_schema"], "BYTES"),
               "guided_decoding_guide": ([json.dumps(SCHEMA)], "BYTES")}
    status, body, _ = http(served.http, "/v2/models/ensemble/infer", kserve_json(tensors))
    assert status == 200 and body["outputs"][0]["data"][0] == want, body
    code, details, resp = grpc_unary(served.grpc, grpc_request(tensors))
    assert output(resp, "text_output")[0] == want, details
    parts = grpc_stream(served.grpc, grpc_request(tensors | {"stream": ([True], "BOOL")}))
    assert "".join(output(r.infer_response, "text_output")[0] for r in parts) == want
    status, body, _ = http(served.http, "/v2/models/ensemble/generate",
                           {"text_input": PROMPT, "max_tokens": 30, "exclude_input_in_output": True,
                            "guided_decoding_guide_type": "json_schema",
                            "guided_decoding_guide": json.dumps(SCHEMA)})
    assert status == 200 and body["text_output"] == want, body


@pytest.mark.parametrize("extra, param, says", [
    ({"guided_regex": "(ab", "guided_choice": ["a"]}, "response_format", "send one structured-output request"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "needs"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be"),
    ({"guided_choice": "Paris"}, "guided_choice", "list of strings"),
    ({"guided_choice": []}, "guided_choice", "non-empty strings"),
    ({"guided_json": "[1, 2]"}, "guided_json", "JSON object"),
    ({"guided_json": 5}, "guided_json", "JSON schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "(ab"}, None, "does not compile"),
    ({"guided_grammar": "answer ::= \"x\""}, None, "root"),
])
def test_a_bad_guide_is_a_400_naming_the_field(served, extra, param, says):
    status, body, _ = http(served.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4} | extra)
    assert status == 400 and says in body["error"]["message"], body
    assert param is None or body["error"]["param"] == param, body
