"""The official `openai` Python SDK against a running `tandem serve`: exact greedy text streamed and
not, logprobs (chat top_logprobs, completions logprobs + echo) equal to the engine's own, extra
fields, and typed errors (404, 400; 401 and 429 from a stack that wants a key and admits one request at a time)."""

from __future__ import annotations

import pytest

from engine.generate import run_generation
from engine.tokenizer import ChatMessage
from tandem.sampling_params import SamplingParams
from tests.conftest import GUARD_KEY, complete
from tests.serve.hold import held

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def _reference(engine, ids, n, **kw):
    return complete(engine, ids, SamplingParams(max_tokens=n, logprobs=True, **kw))


def test_completions_streamed_and_not_are_exact(client, default_engine):
    want = run_generation(default_engine, default_engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=16)).text
    got = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=16, temperature=0)
    assert got.choices[0].text == want and got.usage.completion_tokens == 16
    parts = [c.choices[0].text for c in client.completions.create(model="smollm2-135m", prompt=PROMPT,
                                                                   max_tokens=16, temperature=0, stream=True)]
    assert "".join(parts) == want and len(parts) > 3


def test_chat_streamed_and_not_are_exact(client, default_engine):
    ids = default_engine.tokenizer.encode_chat([ChatMessage("user", QUESTION)])
    want = run_generation(default_engine, ids, SamplingParams(max_tokens=24)).text
    msgs = [{"role": "user", "content": QUESTION}]
    got = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == want
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens


def test_continuous_usage_stats_count_every_chunk(client):
    chunks = list(client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and len(set(counts)) > 3 and counts[-1] == 12
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0 for c in chunks)
    plain = list(client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 12


def test_chat_logprobs_and_top_logprobs_equal_the_engines(client, default_engine):
    ids = default_engine.tokenizer.encode_chat([ChatMessage("user", QUESTION)])
    ref = _reference(default_engine, ids, 8, top_logprobs=3)
    msgs = [{"role": "user", "content": QUESTION}]
    for stream in (False, True):
        reply = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=8, temperature=0,
                                               logprobs=True, top_logprobs=3, stream=stream)
        content = [e for c in reply for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])] \
            if stream else reply.choices[0].logprobs.content
        assert [e.logprob for e in content] == pytest.approx(ref.output_logprobs, abs=1e-3)
        tok = default_engine.tokenizer
        assert [e.token for e in content] == [tok.decode([t], skip_special_tokens=False) for t in ref.output_ids]
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content)  # greedy
        assert bytes(content[0].bytes).decode() == content[0].token


def test_completions_logprobs_with_echo_cover_the_prompt(client, default_engine):
    ids = default_engine.tokenizer.encode(PROMPT)
    ref = _reference(default_engine, ids, 5, top_logprobs=2, prompt_logprobs=True)
    got = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                    echo=True)
    choice = choice_of = got.choices[0]
    assert choice.text.startswith(PROMPT) and choice.text == PROMPT + default_engine.tokenizer.decode(ref.output_ids)
    lp = choice_of.logprobs
    assert len(lp.tokens) == len(ids) + 5 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [r.logprob for r in ref.prompt_logprobs] + ref.output_logprobs
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    assert all(len(d) in (2, 3) for d in lp.top_logprobs[1:])  # 2 alternatives, plus the chosen one if not among them
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    plain = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def test_vllm_sampling_fields_ride_in_extra_body(client, default_engine):
    ids = default_engine.tokenizer.encode(PROMPT)
    want = run_generation(default_engine, ids, SamplingParams(max_tokens=12, repetition_penalty=1.3)).text
    got = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=12, temperature=0,
                                    user="someone", extra_body={"repetition_penalty": 1.3, "min_p": 0.1,
                                                                "ignore_eos": True, "a_field_we_never_heard_of": 1})
    assert got.choices[0].text == want
    first = complete(default_engine, ids, SamplingParams(max_tokens=4)).output_ids[0]
    stopped = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"stop_token_ids": [first]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].text == ""  # the stop token's text is not the answer's (as vLLM renders it) ...
    kept = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [first], "include_stop_str_in_output": True})
    assert kept.choices[0].text == default_engine.tokenizer.decode([first])  # ... unless the request keeps it


def test_logit_bias_steers_the_disaggregated_answer_exactly_as_one_engine(client, default_engine):
    """Prefill chooses the first token and decode the rest, each adding the bias: the answer equals one
    engine's, and differs from the unbiased one (its first token is banned)."""
    ids = default_engine.tokenizer.encode(PROMPT)
    first = complete(default_engine, ids, SamplingParams(max_tokens=4)).output_ids[0]
    favoured = default_engine.tokenizer.encode(" London")[0]
    bias = {str(first): -100, str(favoured): 5}
    want = default_engine.tokenizer.decode(complete(default_engine, ids, SamplingParams(
        max_tokens=10, logit_bias=tuple(sorted((int(k), float(v)) for k, v in bias.items())))).output_ids)
    for stream in (False, True):
        got = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=10, temperature=0,
                                        logit_bias=bias, stream=stream)
        text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert text == want and not text.startswith(default_engine.tokenizer.decode([first]))


def test_vllms_text_options_keep_the_stop_string_and_the_special_tokens(client, default_engine):
    tok = default_engine.tokenizer
    ids = tok.encode(PROMPT)
    full = tok.decode(complete(default_engine, ids, SamplingParams(max_tokens=8)).output_ids)
    stop = full[3:7]  # a stop string inside the greedy answer, so the answer ends early
    for stream in (False, True):
        got = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                        stream=stream, extra_body={"include_stop_str_in_output": True})
        text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert text == full[:full.index(stop) + len(stop)], (text, stop)
    chat = [ChatMessage("user", QUESTION)]
    out = complete(default_engine, tok.encode_chat(chat), SamplingParams(max_tokens=48)).output_ids
    assert out[-1] == tok.eos_token_id  # the answer ends with its end token, within 48 tokens
    for extra, want in [({"skip_special_tokens": False}, tok.decode(out[:-1], skip_special_tokens=False)),
                        ({"skip_special_tokens": False, "include_stop_str_in_output": True},
                         tok.decode(out, skip_special_tokens=False))]:
        got = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}],
                                             max_tokens=48, temperature=0, extra_body=extra)
        assert got.choices[0].message.content == want and got.choices[0].finish_reason == "stop", extra
    assert want.endswith("<|im_end|>")  # the end token is shown only when the request keeps its stop


def test_stop_reason_names_the_stop_string_or_stop_token_that_ended_the_answer(client, default_engine):
    """vLLM's choice field: the stop string met, the stop token ended on; null for the model's end
    token and for max_tokens. Streamed, only the last chunk of the choice carries it."""
    tok = default_engine.tokenizer
    ids = tok.encode(PROMPT)
    out = complete(default_engine, ids, SamplingParams(max_tokens=8)).output_ids
    full = tok.decode(out)
    kw = dict(model="smollm2-135m", prompt=PROMPT, max_tokens=8, temperature=0)
    by_string = client.completions.create(**kw, stop=[full[3:7]]).choices[0]
    assert by_string.finish_reason == "stop" and by_string.model_dump()["stop_reason"] == full[3:7]
    by_token = client.completions.create(**kw, extra_body={"stop_token_ids": [out[0]]}).choices[0]
    assert by_token.finish_reason == "stop" and by_token.model_dump()["stop_reason"] == out[0]
    by_length = client.completions.create(**kw).choices[0]
    assert by_length.finish_reason == "length" and by_length.model_dump()["stop_reason"] is None
    by_end = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=48, temperature=0).choices[0]
    assert by_end.finish_reason == "stop" and by_end.model_dump()["stop_reason"] is None  # the end token
    chunks = [c.choices[0].model_dump() for c in client.completions.create(**kw, stop=[full[3:7]], stream=True)]
    assert chunks[-1]["stop_reason"] == full[3:7] and all(c["stop_reason"] is None for c in chunks[:-1])


def test_chat_echo_starts_the_answer_with_the_assistant_message_it_continues(client):
    """vLLM's chat echo: the final message, when it is the assistant's, comes first in the answer (whole
    and streamed); any other final message is not echoed; with tool calls echo is a 400."""
    start = "The capital of France is"
    msgs = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": start}]
    kw = dict(model="smollm2-135m", messages=msgs, max_tokens=8, temperature=0,
              extra_body={"continue_final_message": True, "add_generation_prompt": False})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    echo = dict(kw, extra_body=kw["extra_body"] | {"echo": True})
    assert plain and client.chat.completions.create(**echo).choices[0].message.content == start + plain
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**echo, stream=True)]
    assert "".join(parts) == start + plain and next(p for p in parts if p).startswith(start)
    ask = dict(model="smollm2-135m", messages=msgs[:1], max_tokens=8, temperature=0)
    assert client.chat.completions.create(**ask, extra_body={"echo": True}).choices[0].message.content == \
        client.chat.completions.create(**ask).choices[0].message.content
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="echo and tool calls exclude each other"):
        client.chat.completions.create(**ask, tools=[tool], tool_choice="required", extra_body={"echo": True})


def test_typed_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert client.models.retrieve("smollm2-135m").id == "smollm2-135m"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], n=65)
    assert e.value.body["param"] == "n" and "in [1, 64]" in e.value.body["message"]


def test_seeded_sampling_with_a_penalty_is_the_same_split_across_prefill_and_decode(client, default_engine):
    """Prefill samples the first token, decode the rest (reading the tokens so far for the penalty): the
    answer equals one engine doing it all."""
    ids = default_engine.tokenizer.encode(PROMPT)
    p = SamplingParams(max_tokens=12, temperature=0.9, seed=5, repetition_penalty=1.2, min_p=0.05)
    want = default_engine.tokenizer.decode(complete(default_engine, ids, p).output_ids)
    got = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=5,
                                    extra_body={"repetition_penalty": 1.2, "min_p": 0.05})
    assert got.choices[0].text == want


def test_echo_streams_the_prompt_first(client, default_engine):
    chunks = list(client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=5, temperature=0,
                                            echo=True, logprobs=1, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == len(default_engine.tokenizer.encode(PROMPT)) + 5


def test_a_missing_or_wrong_key_is_an_authentication_error(guarded):
    for key in ("not-the-key-0123456789", None):
        headers = {} if key else {"Authorization": ""}  # the SDK insists on a key: send an empty header instead
        with openai.OpenAI(base_url=guarded.http + "/v1", api_key=key or "x", max_retries=0, timeout=120,
                           default_headers=headers) as c:
            with pytest.raises(openai.AuthenticationError) as e:
                c.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=4)
            assert e.value.status_code == 401 and e.value.body["code"] == "UNAUTHENTICATED"
    with openai.OpenAI(base_url=guarded.http + "/v1", api_key=GUARD_KEY, max_retries=0, timeout=120) as c:
        assert c.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=4,
                                    temperature=0).usage.completion_tokens == 4


def test_over_the_admission_limit_is_a_rate_limit_error(guarded):
    """One request is held in flight (its prefill worker paused): the next is refused at once, typed."""
    auth = {"Authorization": f"Bearer {GUARD_KEY}"}
    with openai.OpenAI(base_url=guarded.http + "/v1", api_key=GUARD_KEY, max_retries=0, timeout=120) as c:
        with held(guarded, headers=auth) as first:
            with pytest.raises(openai.RateLimitError) as e:
                c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=4)
            assert e.value.status_code == 429 and e.value.body["code"] == "RESOURCE_EXHAUSTED"
            assert "1 requests in flight (limit 1)" in e.value.body["message"]
        assert first.result(timeout=120)[0] == 200
        assert c.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=4,
                                    temperature=0).usage.completion_tokens == 4


def test_max_tokens_0_with_echo_scores_the_prompt_alone(client, default_engine):
    """OpenAI's legacy scoring call (older evaluation harnesses send it): the answer is the prompt with
    its logprobs, and nothing generated is shown or counted."""
    ids = default_engine.tokenizer.encode(PROMPT)
    ref = _reference(default_engine, ids, 1, prompt_logprobs=True)
    for stream in (False, True):
        got = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                        stream=stream, stream_options={"include_usage": True} if stream else None)
        chunks = list(got) if stream else [got]
        choices = [c.choices[0] for c in chunks if c.choices]
        assert "".join(c.text for c in choices) == PROMPT and choices[-1].finish_reason == "length"
        lps = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
        assert lps[0] is None and lps[1:] == pytest.approx([r.logprob for r in ref.prompt_logprobs], abs=1e-3)
        assert len(lps) == len(ids) and chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=0)


def test_chat_continues_a_final_assistant_message(client, default_engine):
    """vLLM's continue_final_message: the assistant's turn is left open after its given start, and the
    answer continues it exactly as one engine continues that text."""
    tok = default_engine.tokenizer
    msgs = [ChatMessage("user", QUESTION), ChatMessage("assistant", "The capital of France is")]
    ids = tok.encode_chat(msgs, None, add_generation_prompt=False, continue_final=True)
    assert tok.decode(ids).endswith("The capital of France is")  # no end of turn after it
    want = tok.decode(complete(default_engine, ids, SamplingParams(max_tokens=8)).output_ids)
    body = [{"role": m.role, "content": m.content} for m in msgs]
    got = client.chat.completions.create(model="smollm2-135m", messages=body, max_tokens=8, temperature=0,
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert got.choices[0].message.content == want and got.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="exclude each other"):
        client.chat.completions.create(model="smollm2-135m", messages=body, max_tokens=8,
                                       extra_body={"continue_final_message": True})
