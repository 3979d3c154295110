"""Reasoning parsers (`tandem serve --reasoning-parser`): the splitter alone (streamed in any pieces it
splits as it does whole), then real stacks under each parser, asked through the official `openai` SDK.

The default model does not think, but it copies a pattern: continuing an assistant turn of questions
answered as `<think>...</think>` and `A: ...`, it writes the next answer that way. The test reads the
raw answer from the session's stack (no parser) and splits it itself (str.partition), so what is
checked is the parser's rule on a real model's text: chat's `reasoning` (and `reasoning_content`) apart
from the content, whole and streamed, and its tokens counted in usage; Responses' reasoning item before
its message, whole and streamed; deepseek_r1 reads an answer without tags as all reasoning, qwen3 as all content; an answer
under a guide is all content; a reasoning input item is dropped."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontdoor.core import Delta
from frontdoor.reasoning_text import ThinkSplitter, ThoughtTokens
from tests.conftest import start_serve, stop_serve
from tests.serve.test_door_conformance import http

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
SHOTS = "Q: 2+2?\n<think>2 plus 2 is 4.</think>\nA: 4\nQ: 5+1?\n<think>5 plus 1 is 6.</think>\nA: 6\nQ: 3+3?\n"
THINKING = {"messages": [{"role": "user", "content": "Answer each question."},
                         {"role": "assistant", "content": SHOTS}],
            "max_tokens": 24, "temperature": 0, "continue_final_message": True, "add_generation_prompt": False}
PLAIN = {"messages": [{"role": "user", "content": "Name a large city."}], "max_tokens": 12, "temperature": 0}


def _expected(raw: str, parser: str) -> tuple[str | None, str]:
    """(reasoning, content) of a raw answer by the parsers' documented rule, written out independently."""
    lead = raw.lstrip()
    if lead.startswith("<think>"):
        thinking = lead[len("<think>"):]
    elif parser == "deepseek_r1":
        thinking = raw
    else:
        return None, raw
    reasoning, tag, content = thinking.partition("</think>")
    return reasoning, content.lstrip() if tag else ""


TEXTS = st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "t", "h", "think", ">", " ", "\n", "a"]),
                 max_size=6).map("".join)  # pieces made of tags, their parts, spaces and text


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(TEXTS, max_size=12), parser=st.sampled_from(["deepseek_r1", "qwen3"]))
def test_the_splitter_splits_any_pieces_as_it_splits_the_whole(pieces, parser):
    whole = ThinkSplitter(parser == "deepseek_r1").whole("".join(pieces))
    split, reasoning, content = ThinkSplitter(parser == "deepseek_r1"), "", ""
    for p in pieces:
        r, c = split.feed(p)
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    assert (reasoning + r if split.thought else None, content + c) == whole == _expected("".join(pieces), parser)


def _reasoning_end(text: str, parser: str) -> float | None:
    """Where a whole answer's reasoning ends: just after its </think>, or never (infinity) when it does not
    close; None: it has none. The parsers' rule again, on offsets."""
    lead = len(text) - len(text.lstrip())
    if text[lead:].startswith("<think>"):
        start = lead + len("<think>")
    elif parser == "deepseek_r1":
        start = 0
    else:
        return None
    end = text.find("</think>", start)
    return float("inf") if end < 0 else end + len("</think>")


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(TEXTS, max_size=12), parser=st.sampled_from(["deepseek_r1", "qwen3"]))
def test_the_reasoning_tokens_are_the_tokens_made_until_the_reasoning_ended(pieces, parser):
    """One token a delta: a token counts when its text starts before the reasoning's end (every token, when
    the reasoning never ends)."""
    counted = ThoughtTokens(parser)
    for p in pieces:
        counted.add(Delta(p, token=1, logprob=None))
    end, starts = _reasoning_end("".join(pieces), parser), [len("".join(pieces[:i])) for i in range(len(pieces))]
    assert counted.total() == (0 if end is None else sum(start < end for start in starts))


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def thinking(request, built_engines, tmp_path_factory):
    s = start_serve(built_engines, tmp_path_factory.mktemp(f"serve-{request.param}"), "--reasoning-parser",
                    request.param)
    c = openai.OpenAI(base_url=s.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield request.param, s, c
    c.close()
    stop_serve(s)


def _raw(served, body: dict) -> str:
    status, reply, _ = http(served.http, "/v1/chat/completions", {"model": MODEL} | body)
    assert status == 200, reply
    return reply["choices"][0]["message"]["content"]


def _chat(client, body: dict, **more):
    extra = {k: body[k] for k in ("continue_final_message", "add_generation_prompt") if k in body}
    return client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=body["max_tokens"],
                                          temperature=0, extra_body=extra or None, **more)


@pytest.mark.parametrize("body", [THINKING, PLAIN], ids=["thinking", "plain"])
def test_chat_carries_the_reasoning_apart_whole_and_streamed(served, thinking, body):
    parser, _, client = thinking
    raw = _raw(served, body)
    reasoning, content = _expected(raw, parser)
    if body is THINKING:
        assert raw.lstrip().startswith("<think>") and "</think>" in raw, raw  # the model followed the pattern
    reply = _chat(client, body)
    message, used = reply.choices[0].message, reply.usage
    assert getattr(message, "reasoning", None) == getattr(message, "reasoning_content", None) == reasoning
    thought = used.completion_tokens_details.reasoning_tokens
    if body is THINKING:
        assert 0 < thought < used.completion_tokens  # the tokens until </think>; the content's after them
    else:  # no tags: all reasoning (deepseek_r1) or none (qwen3)
        assert thought == (used.completion_tokens if parser == "deepseek_r1" else 0)
    assert message.content == (content or None if reasoning is not None else content)
    chunks = list(_chat(client, body, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thought and not chunks[-1].choices
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == (reasoning or "")
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (reasoning or "")
    assert "".join(d.content or "" for d in deltas) == content and deltas[0].role == "assistant"
    steady = list(_chat(client, body, stream=True, stream_options={"include_usage": True,
                                                                    "continuous_usage_stats": True}))
    so_far = [(c.usage.completion_tokens_details.reasoning_tokens, c.usage.completion_tokens) for c in steady
              if c.choices]  # vLLM's continuous usage: each chunk's counts so far
    assert so_far == sorted(so_far) and all(r <= n for r, n in so_far) and so_far[-1][0] == thought


def test_a_response_has_its_reasoning_item_before_its_message_whole_and_streamed(served, thinking):
    parser, _, client = thinking
    reasoning, content = _expected(_raw(served, THINKING), parser)
    ask = {"model": MODEL, "input": THINKING["messages"], "max_output_tokens": THINKING["max_tokens"],
           "temperature": 0, "extra_body": {"continue_final_message": True, "add_generation_prompt": False}}
    got = client.responses.create(**ask)
    assert [o.type for o in got.output] == ["reasoning", "message"]
    assert got.output[0].content[0].text == reasoning and got.output_text == content
    thought = got.usage.output_tokens_details.reasoning_tokens
    assert 0 < thought < got.usage.output_tokens  # the tokens until </think>; the content's after them
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "message"] and done.output[0].content[0].text == reasoning
    assert done.usage.output_tokens_details.reasoning_tokens == thought
    follow = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Name a river."},
                                                         got.output[0].model_dump(exclude_none=True)],
                                     max_output_tokens=8, temperature=0)
    plain = client.responses.create(model=MODEL, input="Name a river.", max_output_tokens=8, temperature=0)
    all_of_it = plain.usage.output_tokens if parser == "deepseek_r1" else 0  # no tags: all reasoning, or none
    assert plain.usage.output_tokens_details.reasoning_tokens == all_of_it
    assert [o.model_dump(exclude={"id"}) for o in follow.output] == \
        [o.model_dump(exclude={"id"}) for o in plain.output]  # the reasoning item given back is dropped


def test_an_answer_under_a_guide_is_all_content(thinking):
    _, _, client = thinking
    got = client.chat.completions.create(model=MODEL, messages=PLAIN["messages"], max_tokens=24, temperature=0,
                                         response_format={"type": "json_object"})
    message = got.choices[0].message
    assert getattr(message, "reasoning", None) is None and message.content.lstrip().startswith("{")


def test_logprobs_of_a_split_response_are_refused(thinking):
    _, serve, _ = thinking
    status, reply, _ = http(serve.http, "/v1/responses", {"model": MODEL, "input": "Hi",
                                                          "include": ["message.output_text.logprobs"]})
    assert status == 400 and reply["error"]["param"] == "include", reply
