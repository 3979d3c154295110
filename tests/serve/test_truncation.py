"""Dropping a chat's oldest turns until it fits the context (the Responses API's `truncation: "auto"`,
control/requests.py), with the default model's real tokenizer and chat template: over generated
conversations the prompt is the one an independent scan picks (the leading system messages, then the
conversation from the earliest user message after which it fits with its max_tokens); a conversation
that fits is left whole; where even the last turn does not fit, the refusal names its length. And on a
real stack whose context is capped (`tandem serve --max-model-len`, which every request and /tokenize and
/v1/models follow): through the SDK, the response is the chat door's answer to the turns kept, counted
as such, where "disabled" is a 400."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.requests import GenerationRequest, Limits, prepare
from engine.tokenizer import ChatMessage
from tandem.status import InvalidArgument
from tests.conftest import start_serve, stop_serve
from tests.serve.test_door_conformance import http

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
CAP = 512
WORDS = st.lists(st.sampled_from(["river", "stone", "light", "seven", "blue", "north", "quiet", "tide"]),
                 min_size=1, max_size=12).map(" ".join)


@st.composite
def conversations(draw) -> tuple[ChatMessage, ...]:
    """Leading system messages, then turns: a user message and maybe the assistant's answer (or its call
    and the tool's answer), ending on a user message."""
    out = [ChatMessage("system", draw(WORDS)) for _ in range(draw(st.integers(0, 2)))]
    for _ in range(draw(st.integers(1, 6))):
        out.append(ChatMessage("user", draw(WORDS)))
        if draw(st.booleans()):
            out.append(ChatMessage("assistant", draw(WORDS)))
        if draw(st.booleans()):
            out.append(ChatMessage("tool", draw(WORDS)))
    return (*out, ChatMessage("user", draw(WORDS)))


def _scan(tok, messages: tuple[ChatMessage, ...], room: int, max_context: int) -> list[int] | None:
    """The prompt an independent reading of the rule keeps: try every cut in order, oldest first."""
    head = 0
    while head < len(messages) and messages[head].role == "system":
        head += 1
    for cut in [head, *(i for i in range(head + 1, len(messages)) if messages[i].role == "user")]:
        ids = tok.encode_chat([*messages[:head], *messages[cut:]])
        if len(ids) + room <= max_context:
            return ids
    return None


@settings(max_examples=60, deadline=None)
@given(messages=conversations(), max_context=st.integers(40, 400), room=st.integers(1, 30))
def test_the_earliest_cut_that_fits_is_kept(default_engine, messages, max_context, room):
    tok = default_engine.tokenizer
    limits = Limits(max_context=max_context, vocab_size=tok.vocab_size)
    req = GenerationRequest("r", messages=messages, max_tokens=room, drop_oldest_turns=True)
    want = _scan(tok, messages, room, max_context)
    if want is None:
        with pytest.raises(InvalidArgument, match="context"):
            prepare(req, tok, limits)
        return
    assert prepare(req, tok, limits).prompt_ids == want
    whole = tok.encode_chat(list(messages))
    if len(whole) + room <= max_context:
        assert want == whole  # a conversation that fits is left whole


def test_without_it_a_conversation_past_the_context_is_refused(default_engine):
    tok = default_engine.tokenizer
    messages = (ChatMessage("user", "river " * 40), ChatMessage("assistant", "stone"), ChatMessage("user", "blue"))
    limits = Limits(max_context=40, vocab_size=tok.vocab_size)  # the whole: 84 tokens; the last turn: 31
    with pytest.raises(InvalidArgument, match="context"):
        prepare(GenerationRequest("r", messages=messages, max_tokens=4), tok, limits)
    kept = prepare(GenerationRequest("r", messages=messages, max_tokens=4, drop_oldest_turns=True), tok, limits)
    assert kept.prompt_ids == tok.encode_chat([messages[-1]])


@pytest.fixture(scope="module")
def capped(built_engines, tmp_path_factory):
    """A 1P1D stack whose requests may use 512 tokens (`--max-model-len`), well within its KV pools."""
    s = start_serve(built_engines, tmp_path_factory.mktemp("serve-capped"), "--max-model-len", str(CAP))
    yield s
    stop_serve(s)


def test_max_model_len_caps_every_request_and_is_what_clients_are_told(capped):
    status, got, _ = http(capped.http, "/tokenize", {"model": MODEL, "prompt": "Hi"})
    assert status == 200 and got["max_model_len"] == CAP, got
    status, got, _ = http(capped.http, "/v1/models", method="GET")
    assert got["data"][0]["max_model_len"] == CAP, got
    status, reply, _ = http(capped.http, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": CAP})
    assert status == 400 and reply["error"]["param"] == "max_tokens" and str(CAP) in reply["error"]["message"]
    status, reply, _ = http(capped.http, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4})
    assert status == 200, reply


def test_a_response_with_truncation_auto_answers_the_turns_that_fit(capped):
    client = openai.OpenAI(base_url=capped.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    rule = "Answer with one word."
    turns = [{"role": "user", "content": f"Tell me fact number {i} about rivers."} if i % 2 == 0 else
             {"role": "assistant", "content": "Rivers carry water from high ground to the sea. " * 4}
             for i in range(9)]  # user, assistant, ..., user

    def count(messages) -> int:
        status, got, _ = http(capped.http, "/tokenize", {"model": MODEL, "messages": messages})
        assert status == 200, got
        return got["count"]
    system = [{"role": "system", "content": rule}]
    n_last3 = count(system + turns[-3:])
    room = CAP - n_last3  # the last three messages (user, assistant, user) fit exactly; five would not
    assert count(system + turns[-5:]) + room > CAP
    ask = {"model": MODEL, "instructions": rule, "input": turns, "max_output_tokens": room, "temperature": 0,
           "extra_body": {"stop": ["\n", "."]}}
    got = client.responses.create(truncation="auto", **ask)
    want = client.chat.completions.create(model=MODEL, messages=system + turns[-3:], max_tokens=room,
                                          temperature=0, stop=["\n", "."])
    assert got.truncation == "auto" and got.usage.input_tokens == n_last3 == want.usage.prompt_tokens
    assert got.output_text == want.choices[0].message.content
    status, reply, _ = http(capped.http, "/v1/responses", {k: v for k, v in ask.items() if k != "extra_body"})
    assert status == 400 and reply["error"]["param"] == "max_output_tokens", reply  # disabled: the default
    client.close()

