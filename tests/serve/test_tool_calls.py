"""Tool calls through the official SDK on a real 1P1D stack: tool_choice "required" or a named function
forces the answer to be the call's JSON (a guide), shaped as OpenAI `tool_calls`, streamed and not, each
exactly the engine's own guided answer; "auto" on a server without a tool-call parser (test_tool_auto.py
has one) and malformed tools are 400s naming the field."""

from __future__ import annotations

import json

import pytest

from engine.tokenizer import ChatMessage
from frontdoor.openai_tools import tool_choice
from tandem.sampling_params import SamplingParams
from tests.conftest import complete
from tests.serve.test_door_conformance import http

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


def _engine_text(engine, body: dict, **params) -> str:
    """The engine's own answer to the chat with the tools shown, under the guide the door derives."""
    tools = tuple(body["tools"])
    ids = engine.tokenizer.encode_chat([ChatMessage(m["role"], m["content"]) for m in ASK], list(tools))
    guide = tool_choice(body, tools).guide
    return engine.tokenizer.decode(complete(engine, ids, SamplingParams(guide=guide, **params)).output_ids)


def _streamed_calls(chunks) -> dict[int, dict]:
    """index -> {"id", "name", "arguments"} accumulated over a stream's tool_call deltas."""
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] = call["name"] or d.function.name
            call["arguments"] += d.function.arguments or ""
    return calls


def test_a_named_function_is_called_with_the_engines_arguments(openai_client, default_engine):
    named = {"type": "function", "function": {"name": "get_weather"}}
    want = _engine_text(default_engine, {"tools": [WEATHER, TIME], "tool_choice": named}, max_tokens=40,
                        temperature=0.7, seed=9)
    assert set(json.loads(want)) == {"city", "unit"}
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=40, temperature=0.7,
              seed=9)
    got = openai_client.chat.completions.create(**kw)
    msg = got.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1 and msg.tool_calls[0].id.startswith("call_")
    assert (msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments) == ("get_weather", want)
    chunks = list(openai_client.chat.completions.create(stream=True, **kw))
    calls = _streamed_calls(chunks)
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == want
    assert calls[0]["id"].startswith("call_") and chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.tool_calls) > 3  # the arguments, piece by piece


@pytest.mark.parametrize("parallel", [None, False])
def test_required_makes_the_calls_the_engine_chose(openai_client, default_engine, parallel):
    body = {"tools": [WEATHER, TIME], "tool_choice": "required"} | ({} if parallel is None
                                                                     else {"parallel_tool_calls": parallel})
    want = json.loads(_engine_text(default_engine, body, max_tokens=120))
    assert want and (parallel is None or len(want) == 1)
    kw = dict(model=MODEL, messages=ASK, max_tokens=120, temperature=0, **body)
    got = openai_client.chat.completions.create(**kw).choices[0].message.tool_calls
    made = [(c.function.name, json.loads(c.function.arguments)) for c in got]
    assert made == [(c["name"], c["parameters"]) for c in want]
    calls = _streamed_calls(openai_client.chat.completions.create(stream=True, **kw))
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == made


@pytest.mark.parametrize("extra, param, says", [
    ({"tools": [WEATHER]}, "tool_choice", "needs a parser"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "\"required\""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "get_weather"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "tools",
     "distinct name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "distinct name"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "not both"),
])
def test_a_tool_request_we_cannot_honour_is_a_400_naming_the_field(served, extra, param, says):
    status, body, _ = http(served.http, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4} | extra)
    assert status == 400 and body["error"]["param"] == param and says in body["error"]["message"], body


def test_tool_choice_none_answers_text_with_the_tools_shown(openai_client):
    got = openai_client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                                max_tokens=8, temperature=0)
    assert got.choices[0].message.content and not got.choices[0].message.tool_calls


def test_a_conversation_that_used_a_tool_is_accepted_and_a_malformed_call_is_a_400(served):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    status, body, _ = http(served.http, "/v1/chat/completions", {"messages": history, "max_tokens": 8,
                                                                 "tools": [WEATHER], "tool_choice": "none"})
    assert status == 200 and body["choices"][0]["message"]["content"], body
    for bad in ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]}],
                [{"role": "user", "content": "x", "tool_calls": [call]}],
                [{"role": "tool", "content": "x", "tool_call_id": 5}]):
        status, body, _ = http(served.http, "/v1/chat/completions", {"messages": ASK + bad, "max_tokens": 4})
        assert status == 400 and body["error"]["param"] == "messages", body
