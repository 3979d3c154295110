"""Several answers in one OpenAI request, through the official SDK against a running `tandem serve`.

A batch of prompts, and `n` answers of each, come back as the reply's choices (choice i * n + j is
answer j of prompt i), served concurrently. Each choice is exactly what a request of its own gets
(answer j samples with seed + j), streamed or not; usage counts each prompt once and every answer's
tokens; a refusal of any answer is the request's HTTP status, and it leaves nothing held."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict

import pytest

from tests.conftest import GUARD_KEY
from tests.serve.clients import pages_used
from tests.serve.hold import in_flight

openai = pytest.importorskip("openai")

PROMPTS = ["The capital of France is", "1, 2, 3,"]
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def _texts(reply, stream: bool, chat: bool = False) -> dict[int, str]:
    """Each choice's whole text by index, from a reply or from the chunks of a stream."""
    if not stream:
        return {c.index: c.message.content if chat else c.text for c in reply.choices}
    texts = defaultdict(str)
    for chunk in reply:
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
    return dict(texts)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_batch_of_prompts_gets_each_prompts_own_answer(client, default_engine, stream):
    ids = default_engine.tokenizer.encode("Once upon a time")
    prompts = [*PROMPTS, ids]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, stream=stream)
    assert _texts(got, stream) == {i: a.choices[0].text for i, a in enumerate(alone)}
    if not stream:
        assert got.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert got.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) == 24


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_seeded_answers_are_each_the_answer_of_the_next_seed(client, stream):
    kw = dict(model=MODEL, max_tokens=10, temperature=1.0, top_p=0.95)
    alone = [client.completions.create(prompt=PROMPTS[0], seed=40 + j, **kw).choices[0].text for j in range(3)]
    assert len(set(alone)) > 1, alone  # the seeds sample different answers, so the check below can fail
    got = client.completions.create(prompt=PROMPTS[0], seed=40, n=3, stream=stream,
                                    stream_options={"include_usage": True} if stream else None, **kw)
    if stream:
        chunks = list(got)
        assert _texts(chunks, True) == dict(enumerate(alone))
        usage = chunks[-1].usage
    else:
        assert _texts(got, False) == dict(enumerate(alone))
        usage = got.usage
    prompt_tokens = client.completions.create(prompt=PROMPTS[0], **kw).usage.prompt_tokens
    assert usage.prompt_tokens == prompt_tokens and usage.completion_tokens == 30  # the prompt counts once


def test_a_batch_with_n_numbers_its_choices_prompt_by_prompt(client):
    kw = dict(model=MODEL, max_tokens=6, temperature=0.8)
    got = client.completions.create(prompt=PROMPTS, n=2, seed=7, **kw)
    want = {i * 2 + j: client.completions.create(prompt=p, seed=7 + j, **kw).choices[0].text
            for i, p in enumerate(PROMPTS) for j in range(2)}
    assert _texts(got, False) == want


def test_chat_streams_n_answers_each_with_its_role_first(client):
    msgs = [{"role": "user", "content": "Name a colour."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=1.0)
    alone = [client.chat.completions.create(seed=3 + j, **kw).choices[0].message.content for j in range(2)]
    chunks = list(client.chat.completions.create(seed=3, n=2, stream=True, logprobs=True, **kw))
    assert _texts(chunks, True, chat=True) == dict(enumerate(alone))
    for j in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == j]
        assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
        assert mine[-1].finish_reason is not None and all(c.logprobs.content for c in mine if c.delta.content)


def test_a_refused_answer_refuses_the_streamed_request_and_the_others_give_back_what_they_hold(served):
    """With the prefill worker paused, answer 0 is admitted and waits for its first token; answer 1's
    prompt is over the context. The request is a 400 (not an SSE stream that fails later), and answer 0
    is cancelled: nothing stays in flight, no page stays held."""
    pgid = served.workers()["prefill-0"]["pid"]
    with openai.OpenAI(base_url=served.http + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        os.killpg(pgid, signal.SIGSTOP)
        try:
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model=MODEL, prompt=[PROMPTS[0], "word " * 9000], max_tokens=4, stream=True)
            assert "model's context" in e.value.body["message"]
        finally:
            os.killpg(pgid, signal.SIGCONT)
        assert in_flight(served) == 0
        assert _settles(lambda: sum(pages_used(served.http).values()) == 0)
        assert c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                    temperature=0).usage.completion_tokens == 4


def test_more_answers_than_admission_ever_lets_in_are_a_client_error(guarded):
    """The guarded stack admits one request at a time: two answers could never be in flight together,
    so the request is a 400 naming the limit, not a 429 that no retry would get past."""
    with openai.OpenAI(base_url=guarded.http + "/v1", api_key=GUARD_KEY, max_retries=0, timeout=120) as c:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, n=2, stream=stream)
            assert "asks for 2 answers" in e.value.body["message"] and "limits.max_in_flight" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError, match="asks for 2 answers"):
            c.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4)
        assert c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                    temperature=0).usage.completion_tokens == 4


def _settles(check, timeout_s: float = 10.0) -> bool:
    """Whether `check()` becomes true within `timeout_s` (pages are given back by messages to the workers)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
