"""tool_choice "auto" on a real 1P1D stack started with `--tool-call-parser hermes` and a chat template
that shows the model its tools (tests/serve/templated.py): the model's own text is read for
`<tool_call>` blocks. An answer that calls nothing is the engine's text, unchanged; an answer that
calls (made to, here, by a regex guide in the Hermes format: the small default model was not trained to
call tools) comes back as OpenAI `tool_calls` with the engine's arguments, its words before the call as
content, finish_reason "tool_calls", streamed and not. The same on stacks started with
`--tool-call-parser llama3_json`, `pythonic` and `mistral`, whose answer is (or here is) the call
itself. The Responses API reads the same calls (as a message item and function_call items). And each
parser's reader, piece by piece, on the texts a model may write."""

from __future__ import annotations

import json
import re

import pytest

from frontdoor.tool_parsers import reader
from tandem.guides import Guide, GuideKind
from tandem.sampling_params import SamplingParams
from tests.conftest import complete
from tests.serve.templated import templated_ids
from tests.serve.test_tool_calls import ASK, MODEL, TIME, WEATHER, _streamed_calls

# a Hermes call of get_weather with a city the model picks: "Checking." then the block
CALL_REGEX = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,12}", '
              r'"unit": "celsius"\}\}\n</tool_call>')


def _engine_text(engine, engines, template: str, guide: Guide | None, **params) -> str:
    ids = templated_ids(engines, template, ASK, [WEATHER, TIME])
    return engine.tokenizer.decode(complete(engine, ids, SamplingParams(guide=guide, **params)).output_ids)


def test_an_answer_without_a_call_is_the_engines_text(templated, default_engine, built_engines):
    hermes, template, _ = templated
    want = _engine_text(default_engine, built_engines, template, None, max_tokens=24)
    assert "<tool_call>" not in want
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=24, temperature=0)  # "auto": the default
    got = hermes.chat.completions.create(**kw).choices[0]
    assert got.message.content == want and not got.message.tool_calls and got.finish_reason == "length"
    chunks = list(hermes.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert not _streamed_calls(chunks) and chunks[-1].choices[0].finish_reason == "length"


def test_a_call_in_the_text_is_a_tool_call_with_the_engines_arguments(templated, default_engine, built_engines):
    hermes, template, _ = templated
    text = _engine_text(default_engine, built_engines, template, Guide(GuideKind.REGEX, CALL_REGEX), max_tokens=60,
                        temperature=0.8, seed=4)
    block = json.loads(text[text.index("<tool_call>") + len("<tool_call>"):text.index("</tool_call>")])
    want = ("get_weather", block["arguments"])
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=60, temperature=0.8,
              seed=4, extra_body={"guided_regex": CALL_REGEX})
    got = hermes.chat.completions.create(**kw).choices[0]
    calls = got.message.tool_calls
    assert got.message.content == "Checking." and got.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [want]
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    chunks = list(hermes.chat.completions.create(stream=True, **kw))
    streamed = _streamed_calls(chunks)
    assert [(streamed[0]["name"], json.loads(streamed[0]["arguments"]))] == [want] and list(streamed) == [0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_responses_api_reads_the_same_calls_in_the_text(templated, default_engine, built_engines):
    """/v1/responses with function tools, "auto": the same text read the same way, as a message item
    ("Checking.") then a function_call item, whole and streamed (each item closed before the next)."""
    hermes, template, _ = templated
    text = _engine_text(default_engine, built_engines, template, Guide(GuideKind.REGEX, CALL_REGEX), max_tokens=60,
                        temperature=0.8, seed=4)
    block = json.loads(text[text.index("<tool_call>") + len("<tool_call>"):text.index("</tool_call>")])
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    kw = dict(model=MODEL, input=ASK, tools=tools, max_output_tokens=60, temperature=0.8,
              extra_body={"seed": 4, "guided_regex": CALL_REGEX})  # vLLM's fields, carried as on chat
    got = hermes.responses.create(**kw)
    assert [o.type for o in got.output] == ["message", "function_call"] and got.status == "completed"
    assert got.output_text == "Checking." and got.output[1].name == "get_weather"
    assert json.loads(got.output[1].arguments) == block["arguments"]
    events = list(hermes.responses.create(stream=True, **kw))
    kinds = [e.type for e in events if e.type not in ("response.output_text.delta",
                                                      "response.function_call_arguments.delta")]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",  # the message ...
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.done",  # ... then the call
                     "response.output_item.done", "response.completed"]
    final = events[-1].response
    assert final.output_text == "Checking." and json.loads(final.output[1].arguments) == block["arguments"]


# a call of get_weather with a city the model picks, as the whole answer: in each whole-answer format,
# with how to read the city back out of the engine's text
WHOLE = {"llama3_json": (r'\{"name": "get_weather", "parameters": \{"city": "[A-Z][a-z]{2,12}", "unit": "celsius"\}\}',
                         lambda text: json.loads(text)["parameters"]["city"]),
         "pythonic": (r'\[get_weather\(city="[A-Z][a-z]{2,12}", unit="celsius"\)\]',
                      lambda text: text.split('"')[1]),
         "mistral": (r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,12}", '
                     r'"unit": "celsius"\}\}\]', lambda text: json.loads(text[12:])[0]["arguments"]["city"])}


ID_FORM = {"mistral": r"[A-Za-z0-9]{9}"}


def test_a_whole_answer_call_is_a_tool_call_with_the_engines_arguments(templated_whole, default_engine, built_engines):
    parser, client, template = templated_whole
    regex, city_of = WHOLE[parser]
    text = _engine_text(default_engine, built_engines, template, Guide(GuideKind.REGEX, regex), max_tokens=60,
                        temperature=0.8, seed=4)
    want = ("get_weather", {"city": city_of(text), "unit": "celsius"})
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0.8, seed=4,
              extra_body={"guided_regex": regex})
    got = client.chat.completions.create(**kw).choices[0]
    assert got.message.content is None and got.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == [want]
    ids = ID_FORM.get(parser, r"call_[0-9a-f]{24}")  # Mistral's templates take back only their own form
    assert re.fullmatch(ids, got.message.tool_calls[0].id), got.message.tool_calls[0].id
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = _streamed_calls(chunks)
    assert [(streamed[0]["name"], json.loads(streamed[0]["arguments"]))] == [want] and list(streamed) == [0]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(**kw | {"extra_body": {}, "max_tokens": 24, "temperature": 0}).choices[0]
    want_text = _engine_text(default_engine, built_engines, template, None, max_tokens=24)
    assert want_text.lstrip()[:1] not in "{["  # an answer that cannot be a call: the engine's text
    assert plain.message.content == want_text and not plain.message.tool_calls


def _read(parser: str, text: str, step: int) -> tuple[str, list]:
    r = reader(parser, frozenset({"get_weather"}))
    content, calls = "", []
    for i in range(0, len(text), step):
        piece, made = r.feed(text[i:i + step])
        content, calls = content + piece, calls + made
    rest, more = r.finish()
    return content + rest, [(c.name, json.loads(c.arguments)) for c in calls + more]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
OSLO = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
ROME = '{"name": "get_weather", "parameters": {"city": "Rome"}}'


# (text, its content, its calls) per parser
HERMES = [
    ("Plain text, < and <tool_ and all.\n\n", "Plain text, < and <tool_ and all.\n\n", []),  # unchanged
    (f"Let me look.\n{CALL}\n{CALL}\n", "Let me look.", [("get_weather", {"city": "Oslo"})] * 2),
    (f"{CALL}\n\nDone, see above.", "Done, see above.", [("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', "",
     [("get_weather", {"city": "Rome"})]),  # arguments as a JSON string
    ('<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>', []),  # not one of the tools: text
    ("<tool_call>{not json}</tool_call> x", "<tool_call>{not json}</tool_call> x", []),
    ('Cut <tool_call>{"name": "get_weather", "argu', 'Cut <tool_call>{"name": "get_weather", "argu', []),
]
LLAMA3_JSON = [
    ("Plain text with {braces}; and all.\n", "Plain text with {braces}; and all.\n", []),  # unchanged
    (OSLO, "", [("get_weather", {"city": "Oslo"})]),
    (f"\n {OSLO}; {ROME}\n", "", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]),
    (f"<|python_tag|>{OSLO}", "", [("get_weather", {"city": "Oslo"})]),  # the tag, when special tokens are kept
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}', "", [("get_weather", {"city": "Rome"})]),
    ('{"name": "delete_all", "parameters": {}}', '{"name": "delete_all", "parameters": {}}', []),  # not a tool
    (f"{OSLO} is what I would call.", f"{OSLO} is what I would call.", []),  # not only calls: text
    (f"{OSLO}; {{not json}}", f"{OSLO}; {{not json}}", []),
    ('{"name": "get_weather", "param', '{"name": "get_weather", "param', []),  # cut short: text
    ("  \n", "  \n", []),
]
PYTHONIC = [
    ("Plain text [with brackets] and f(x).\n", "Plain text [with brackets] and f(x).\n", []),  # unchanged
    ('[get_weather(city="Oslo")]', "", [("get_weather", {"city": "Oslo"})]),
    ('\n[get_weather(city="Oslo", days=[1, 2], extra={"a": None, "b": True}), get_weather(city=\'Rome\')]\n', "",
     [("get_weather", {"city": "Oslo", "days": [1, 2], "extra": {"a": None, "b": True}}),
      ("get_weather", {"city": "Rome"})]),
    ('[get_weather("Oslo")]', '[get_weather("Oslo")]', []),  # positional: not a call
    ('[get_weather(city=__import__("os").getcwd())]', '[get_weather(city=__import__("os").getcwd())]', []),  # not run
    ('[get_weather(city={1, 2})]', '[get_weather(city={1, 2})]', []),  # a set: no JSON form
    ("[delete_all()]", "[delete_all()]", []),  # not one of the tools
    ("[]", "[]", []),
    ('[get_weather(city="Os', '[get_weather(city="Os', []),  # cut short: text
]


V3_CALLS = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, ' \
           '{"name": "get_weather", "arguments": {"city": "Rome"}}]'
V11_CALLS = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
MISTRAL = [
    ("Plain text [with brackets] and [TOOL_ but no tag.\n", "Plain text [with brackets] and [TOOL_ but no tag.\n",
     []),  # unchanged
    (V3_CALLS, "", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]),  # before v11
    (V11_CALLS, "", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]),  # v11 and later
    ('Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]', "Let me look. ",
     [("get_weather", {"city": "Oslo"})]),  # content first; arguments as a JSON string
    ('[TOOL_CALLS][{"name": "delete_all", "arguments": {}}]', '[TOOL_CALLS][{"name": "delete_all", "arguments": {}}]',
     []),  # not one of the tools: text
    ('[TOOL_CALLS]get_weather{"city": "Oslo"}', '[TOOL_CALLS]get_weather{"city": "Oslo"}', []),  # no [ARGS]
    ('[TOOL_CALLS][{"name": "get_weather", "argu', '[TOOL_CALLS][{"name": "get_weather", "argu', []),  # cut short
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
]


@pytest.mark.parametrize("parser, text, content, calls", [("hermes", *c) for c in HERMES]
                         + [("llama3_json", *c) for c in LLAMA3_JSON] + [("pythonic", *c) for c in PYTHONIC]
                         + [("mistral", *c) for c in MISTRAL])
def test_each_reader_finds_the_same_calls_however_the_text_is_cut(parser, text, content, calls):
    for step in (1, 2, 5, len(text)):
        assert _read(parser, text, step) == (content, calls), step


def test_the_llama3_json_reader_gives_text_as_it_comes_once_it_cannot_be_a_call():
    r = reader("llama3_json", frozenset({"get_weather"}))
    assert r.feed(" <|py") == ("", [])  # may be the tag: held
    assert r.feed("thon is a snake") == (" <|python is a snake", [])
    assert r.feed(", not a call.") == (", not a call.", [])
    assert r.finish() == ("", []) and r.calls == 0
