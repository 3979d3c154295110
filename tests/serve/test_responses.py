"""OpenAI's Responses API (POST /v1/responses) on a real 1P1D stack, through the official `openai` SDK:
a response's text is the engine's answer to the chat it amounts to (instructions as the system message),
whole and streamed (the SDK's event types in order, the deltas joining to the text); max_output_tokens
makes it "incomplete"; text.format json_schema gives JSON the schema accepts; what is not served is a
400 naming the field."""

from __future__ import annotations

import json

import pytest

from engine.tokenizer import ChatMessage
from tandem.sampling_params import SamplingParams
from tests.conftest import complete
from tests.serve.test_door_conformance import http

MODEL = "smollm2-135m"
ASK, RULE = "Name a large city.", "Answer in one short sentence."


def _engine_text(engine, messages: list[ChatMessage], n: int) -> tuple[str, int, int]:
    ids = engine.tokenizer.encode_chat(messages)
    seq = complete(engine, ids, SamplingParams(max_tokens=n))
    return engine.tokenizer.decode(seq.output_ids), len(ids), len(seq.output_ids)


def test_a_response_is_the_engines_answer_to_the_chat_it_amounts_to(openai_client, default_engine):
    want, n_in, n_out = _engine_text(default_engine, [ChatMessage("system", RULE), ChatMessage("user", ASK)], 12)
    got = openai_client.responses.create(model=MODEL, instructions=RULE, input=ASK, max_output_tokens=12,
                                         temperature=0)
    assert got.output_text == want and got.object == "response" and got.output[0].role == "assistant"
    assert got.usage.input_tokens == n_in and got.usage.output_tokens == n_out
    assert got.status == ("incomplete" if n_out == 12 else "completed")
    same = openai_client.responses.create(model=MODEL, input=[{"role": "developer", "content": RULE},
                                                              {"role": "user", "content": [
                                                                  {"type": "input_text", "text": ASK}]}],
                                          max_output_tokens=12, temperature=0)
    assert same.output_text == want  # a developer message is a system message; text parts join


def test_a_streamed_response_sends_the_events_in_order_and_its_deltas_make_the_text(openai_client,
                                                                                      default_engine):
    want, _, _ = _engine_text(default_engine, [ChatMessage("user", ASK)], 24)
    events = list(openai_client.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0,
                                                 stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want and [e.sequence_number for e in events] == list(range(len(events)))


def test_max_output_tokens_makes_a_response_incomplete(openai_client):
    got = openai_client.responses.create(model=MODEL, input="Tell me a long story about a lighthouse.",
                                         max_output_tokens=3, temperature=0)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert got.usage.output_tokens == 3


def test_text_format_json_schema_gives_json_the_schema_accepts(openai_client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    got = openai_client.responses.create(model=MODEL, input=ASK, max_output_tokens=40, temperature=0,
                                         text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert got.status == "completed" and set(json.loads(got.output_text)) == {"city"}


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),  # past the context: refused where the chat is prepared
    ({"max_output_tokens": 100000, "stream": True}, "max_output_tokens"),  # streamed: still a status, not an event
    ({"text": {"format": {"type": "xml"}}}, "text"),
])
def test_what_is_not_served_is_a_400_naming_it(served, extra, param):
    status, reply, _ = http(served.http, "/v1/responses", {"model": MODEL, "input": ASK} | extra)
    assert status == 400 and reply["error"]["param"] == param, reply
