"""Anthropic's Messages API (POST /v1/messages) on the session's real stacks, through the official
`anthropic` SDK: a message is the chat door's answer to the chat it amounts to (system, turns, usage),
whole and streamed (the SDK rebuilds the same message from the events); a stop string that ends the text
is its stop_sequence; a forced tool makes a tool_use block, and its tool_result continues the
conversation as the chat door's tool message does; count_tokens counts the prompt a message would have
(with tools too, past the context too); keys come as x-api-key; what is not served is a 400 in
Anthropic's error shape naming what was wrong."""

from __future__ import annotations

import json

import pytest

from tests.conftest import GUARD_KEY
from tests.serve.clients import post
from tests.serve.test_door_conformance import http
from tests.serve.test_tool_calls import ASK as TOOL_ASK
from tests.serve.test_tool_calls import WEATHER

anthropic = pytest.importorskip("anthropic")

MODEL = "smollm2-135m"
SYSTEM = "Answer in one short sentence."
ASK = [{"role": "user", "content": "Name a large city."}]
GREEDY = {"temperature": 0}  # recent SDKs take sampling fields through extra_body only
TOOL = {"name": WEATHER["function"]["name"], "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def client(served):
    with anthropic.Anthropic(base_url=served.http, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(url: str, messages: list[dict], max_tokens: int, **extra) -> dict:
    status, got = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                     "temperature": 0} | extra)
    assert status == 200, got
    return got


def test_a_message_is_the_chat_doors_answer_whole_and_streamed(served, client):
    got = client.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=24, extra_body=GREEDY)
    want = chat(served.http, [{"role": "system", "content": SYSTEM}, *ASK], 24)
    choice = want["choices"][0]
    assert got.type == "message" and got.role == "assistant" and got.model == MODEL and got.id.startswith("msg_")
    assert [b.type for b in got.content] == ["text"] and got.content[0].text == choice["message"]["content"]
    assert got.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice["finish_reason"]]
    assert (got.usage.input_tokens, got.usage.output_tokens) == (want["usage"]["prompt_tokens"],
                                                                 want["usage"]["completion_tokens"])
    with client.messages.stream(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=24, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert streamed.content[0].text == got.content[0].text and streamed.stop_reason == got.stop_reason
    assert streamed.usage.output_tokens == got.usage.output_tokens


def test_a_stop_string_that_ends_the_text_is_its_stop_sequence(client):
    whole = client.messages.create(model=MODEL, messages=ASK, max_tokens=24, extra_body=GREEDY).content[0].text
    words = whole.split()
    assert len(words) >= 3, whole
    stop = f" {words[2]}"
    got = client.messages.create(model=MODEL, messages=ASK, max_tokens=24, extra_body=GREEDY, stop_sequences=[stop])
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)
    assert got.content[0].text == whole[:whole.index(stop)]


def test_a_forced_tool_is_a_tool_use_block_and_its_result_continues_the_conversation(served, client):
    called = client.messages.create(model=MODEL, messages=TOOL_ASK, tools=[TOOL], max_tokens=120, extra_body=GREEDY,
                                    tool_choice={"type": "tool", "name": TOOL["name"]})
    assert called.stop_reason == "tool_use" and called.content[-1].type == "tool_use", called
    use = called.content[-1]
    assert use.name == TOOL["name"] and isinstance(use.input, dict) and use.id
    with client.messages.stream(model=MODEL, messages=TOOL_ASK, tools=[TOOL], max_tokens=120, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": TOOL["name"]}) as s:
        streamed = s.get_final_message()  # rebuilt from input_json_delta events
    assert streamed.stop_reason == "tool_use" and (streamed.content[-1].name, streamed.content[-1].input) == \
        (use.name, use.input)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees, sunny"}
    turns = [*TOOL_ASK, {"role": "assistant", "content": called.content}, {"role": "user", "content": [result]}]
    follow = client.messages.create(model=MODEL, tools=[TOOL], tool_choice={"type": "none"}, max_tokens=16,
                                    extra_body=GREEDY, messages=turns)
    want = chat(served.http, [*TOOL_ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 degrees, sunny"}], 16, tools=[WEATHER],
        tool_choice="none")
    assert follow.content[0].text == want["choices"][0]["message"]["content"]


def test_output_config_gives_json_its_schema_accepts(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    got = client.messages.create(model=MODEL, messages=ASK, max_tokens=40, extra_body=GREEDY,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    city = json.loads(got.content[0].text)
    assert list(city) == ["city"] and isinstance(city["city"], str)


def test_count_tokens_is_the_input_tokens_of_the_message(served, client):
    asked = {"model": MODEL, "system": SYSTEM, "messages": ASK}
    tools = {"tools": [TOOL], "tool_choice": {"type": "tool", "name": TOOL["name"]}}
    plain, with_tools = (client.messages.count_tokens(**asked, **more).input_tokens for more in ({}, tools))
    for more, counted in (({}, plain), (tools, with_tools)):
        sent = client.messages.create(**asked, **more, max_tokens=1, extra_body=GREEDY)
        assert sent.usage.input_tokens == counted, more
    _, info, _ = http(served.http, "/tokenize", {"messages": [{"role": "system", "content": SYSTEM}, *ASK]})
    assert info["count"] == plain
    long = [{"role": "user", "content": " x" * info["max_model_len"]}]
    assert client.messages.count_tokens(model=MODEL, messages=long).input_tokens > info["max_model_len"]
    with pytest.raises(anthropic.BadRequestError):  # counted, though the message itself is refused
        client.messages.create(model=MODEL, messages=long, max_tokens=1)


@pytest.mark.parametrize("body, status, kind, says", [
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": ASK, "max_tokens": 8, "model": "claude-x"}, 404, "not_found_error", "unknown model"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 8}, 400,
     "invalid_request_error", "images"),
    ({"messages": ASK, "max_tokens": 8, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "server tools"),
    ({"messages": ASK, "max_tokens": 8, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tools"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 8}, 400, "invalid_request_error", "role"),
    ({"messages": ASK, "max_tokens": 8, "output_config": {"format": {"type": "xml"}}}, 400, "invalid_request_error",
     "output_config"),
])
def test_what_is_not_served_is_an_error_in_anthropics_shape(served, body, status, kind, says):
    code, reply, _ = http(served.http, "/v1/messages", body)
    assert code == status and reply["type"] == "error" and reply["error"]["type"] == kind, reply
    assert says in reply["error"]["message"], reply


@pytest.mark.parametrize("body, status, kind, says", [
    ({}, 400, "invalid_request_error", "messages"),
    ({"messages": ASK, "model": "claude-x"}, 404, "not_found_error", "unknown model"),
    ({"messages": ASK, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "images"),
])
def test_what_count_tokens_cannot_count_is_an_error_in_anthropics_shape(served, body, status, kind, says):
    code, reply, _ = http(served.http, "/v1/messages/count_tokens", body)
    assert code == status and reply["type"] == "error" and reply["error"]["type"] == kind, reply
    assert says in reply["error"]["message"], reply


def test_the_key_comes_as_x_api_key(guarded):
    with anthropic.Anthropic(base_url=guarded.http, api_key=GUARD_KEY, max_retries=0, timeout=120) as c:
        assert c.messages.create(model=MODEL, messages=ASK, max_tokens=4).content[0].text
    with anthropic.Anthropic(base_url=guarded.http, api_key="not-a-key", max_retries=0, timeout=120) as c:
        with pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(model=MODEL, messages=ASK, max_tokens=4)
    assert e.value.body["error"]["type"] == "authentication_error"
