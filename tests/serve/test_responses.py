"""OpenAI's Responses API (POST /v1/responses) on a real 1P1D stack, through the official `openai` SDK:
a response's text is the engine's answer to the chat it amounts to (instructions as the system message),
whole and streamed (the SDK's event types in order, the deltas joining to the text); max_output_tokens
makes it "incomplete"; text.format json_schema gives JSON the schema accepts; function tools make the
calls the chat door makes for the same request ("required", a named function; test_tool_auto.py has
"auto"), whole and streamed (the SDK's stream accumulator rebuilds the response), and a conversation
that carries calls and their outputs as input items is answered as the chat it amounts to; the logprobs
include gives the chat door's logprobs, whole and streamed (the deltas' entries joining to the text
part's); what is not served is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from engine.tokenizer import ChatMessage
from frontdoor.responses_shape import Shaper
from tandem.sampling_params import SamplingParams
from tests.conftest import complete
from tests.serve.test_door_conformance import http
from tests.serve.test_tool_calls import ASK as TOOL_ASK
from tests.serve.test_tool_calls import TIME, WEATHER

MODEL = "smollm2-135m"
ASK, RULE = "Name a large city.", "Answer in one short sentence."
TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]  # the Responses API's tool shape
LOGPROBS = "message.output_text.logprobs"


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


def _entries(logprobs) -> list[tuple[str, list[str]]]:
    """(token, its alternatives' tokens) of each logprobs entry, SDK objects or chat's."""
    return [(e.token, [a.token for a in e.top_logprobs]) for e in logprobs]


def test_the_logprobs_include_gives_the_chat_doors_logprobs_whole_and_streamed(openai_client):
    chat = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                                 max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    want = chat.choices[0].logprobs.content
    ask = {"model": MODEL, "input": ASK, "max_output_tokens": 16, "temperature": 0, "include": [LOGPROBS],
           "top_logprobs": 3}
    got = openai_client.responses.create(**ask)
    part = got.output[0].content[0]
    assert part.text == chat.choices[0].message.content and len(part.logprobs) == len(want) > 0
    assert _entries(part.logprobs) == _entries(want) and all(len(e.top_logprobs) == 3 for e in want)
    assert [e.logprob for e in part.logprobs] == pytest.approx([e.logprob for e in want], abs=1e-3)
    assert [list(e.token.encode()) for e in part.logprobs] == [e.bytes for e in part.logprobs]

    events = list(openai_client.responses.create(**ask, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert _entries(streamed) == _entries(done.logprobs) == _entries(want)
    assert _entries(events[-1].response.output[0].content[0].logprobs) == _entries(want)

    plain = openai_client.responses.create(**(ask | {"include": ["reasoning.encrypted_content"], "top_logprobs": 0}))
    assert plain.output_text == part.text and plain.output[0].content[0].logprobs == []  # includes nothing made here


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "bad name"}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" (the default) on a server without a tool-call parser
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call", "name": "get_time", "arguments": "{}"}]}, "input"),  # no call_id
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),  # this server keeps no responses
    ({"conversation": "conv_1"}, "conversation"),  # state kept elsewhere: ignoring it would lose it
    ({"prompt": {"id": "pmpt_1", "variables": {"city": "Paris"}}}, "prompt"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"truncation": "middle"}, "truncation"),
    ({"include": ["message.output_text.bogus"]}, "include"),
    ({"include": "message.output_text.logprobs"}, "include"),  # not a list
    ({"top_logprobs": 2}, "top_logprobs"),  # alternatives without the logprobs include
    ({"include": [LOGPROBS], "top_logprobs": 21}, "top_logprobs"),
    ({"include": [LOGPROBS], "top_logprobs": "2"}, "top_logprobs"),
    ({"include": [LOGPROBS], "tools": TOOLS, "tool_choice": "required"}, "include"),  # a call has no logprobs
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


def _calls(output) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in output if o.type == "function_call"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_tools_make_the_calls_the_chat_door_makes(openai_client, choice):
    """The same request on both APIs (the chat its Responses form amounts to): the same calls."""
    chat_choice = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
    chat = openai_client.chat.completions.create(model=MODEL, messages=TOOL_ASK, tools=[WEATHER, TIME],
                                                 tool_choice=chat_choice, max_tokens=120, temperature=0)
    want = [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls]
    kw = dict(model=MODEL, input=TOOL_ASK, tools=TOOLS, tool_choice=choice, max_output_tokens=120, temperature=0)
    got = openai_client.responses.create(**kw)
    assert got.status == "completed" and _calls(got.output) == want and len(got.output) == len(want)
    assert all(o.call_id.startswith("call_") and o.id.startswith("fc_") for o in got.output)
    assert [t.name for t in got.tools] == ["get_weather", "get_time"]
    with openai_client.responses.stream(**kw) as stream:  # the SDK rebuilds the response from the events
        events = list(stream)
        final = stream.get_final_response()
    assert _calls(final.output) == want and final.output[0].call_id == events[-1].response.output[0].call_id
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(want)
    assert kinds.count("response.function_call_arguments.done") == len(want) and "response.output_text.delta" not in kinds
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == "".join(o.arguments for o in final.output)
    if isinstance(choice, dict):  # a named function's arguments stream as they are made
        assert len(pieces) > 3
    assert kinds[-1] == "response.completed" and [e.sequence_number for e in events] == list(range(len(events)))


def test_a_conversation_with_calls_and_their_outputs_is_answered_as_its_chat(openai_client):
    args = '{"city": "Paris", "unit": "celsius"}'
    history = TOOL_ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    chat = openai_client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME],
                                                 tool_choice="none", max_tokens=16, temperature=0)
    items = TOOL_ASK + [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
                        {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, sunny"}]
    got = openai_client.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none",
                                         max_output_tokens=16, temperature=0)
    assert got.output_text == chat.choices[0].message.content and got.output_text
    assert [o.type for o in got.output] == ["message"] and got.usage.input_tokens == chat.usage.prompt_tokens


def test_each_streamed_item_is_closed_before_the_next_opens_whatever_their_order():
    """Text after a call (a model may write on) opens a second message; the response lists all three."""
    shaper = Shaper({"input": "x"}, "resp_1", MODEL, calls=True)
    events = shaper.opening() + shaper.text("Let me look. ") + shaper.call("call_1", "get_time", '{"zone"')
    events += shaper.arguments(': "UTC"}') + shaper.text("Done.")
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 0}}
    events += shaper.closing("stop", usage)
    opened = [(e["type"], e["output_index"]) for e in events if e["type"].startswith("response.output_item.")]
    assert opened == [("response.output_item.added", 0), ("response.output_item.done", 0),
                      ("response.output_item.added", 1), ("response.output_item.done", 1),
                      ("response.output_item.added", 2), ("response.output_item.done", 2)]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(o["type"], o.get("arguments")) for o in final["output"]] == [
        ("message", None), ("function_call", '{"zone": "UTC"}'), ("message", None)]
    assert [o["content"][0]["text"] for o in final["output"] if o["type"] == "message"] == ["Let me look. ", "Done."]
    assert final["usage"]["input_tokens"] == 3 and final["output"][1]["call_id"] == "call_1"


def test_logprobs_of_tokens_whose_text_never_came_close_the_message_in_an_empty_delta():
    """A token held back and then dropped (the start of a stop string) still has its logprobs entry: it
    comes as an empty delta before the message closes, so the deltas' entries join to the part's."""
    shaper = Shaper({"input": "x"}, "resp_1", MODEL, calls=False)
    seen, held = {"token": "Hi", "logprob": -0.5}, {"token": "<", "logprob": -1.5}
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
    events = shaper.opening() + shaper.text("Hi", [seen]) + shaper.closing("stop", usage, [held])
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(e["delta"], e["logprobs"]) for e in deltas] == [("Hi", [seen]), ("", [held])]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == [seen, held] == events[-1]["response"]["output"][0]["content"][0]["logprobs"]
    assert done["text"] == "Hi"
