"""vLLM's `prompt_logprobs` on a real 1P1D stack: every prompt token after the first with its logprob,
rank and k alternatives, `[null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]`, on each
choice of a completion and once at the top of a chat reply, equal to the engine's own report of the
same prompt; the reply's `logprobs` stay as asked (their own number of alternatives, none when not
asked); streamed, or with a k outside 0..20, it is a 400 naming the field."""

from __future__ import annotations

import pytest

from engine.tokenizer import ChatMessage
from tandem.sampling_params import SamplingParams
from tests.conftest import complete
from tests.serve.test_door_conformance import http

MODEL = "smollm2-135m"
PROMPT = "The capital of France is Paris. The capital of Germany is"


def _engine_report(engine, ids: list[int], k: int) -> list:
    return complete(engine, ids, SamplingParams(max_tokens=1, prompt_logprobs=True, top_logprobs=k)).prompt_logprobs


def _check(got: list, ids: list[int], want: list, k: int, decode_one) -> None:
    """`got` is vLLM's prompt_logprobs for prompt `ids`, the engine's report `want` with k alternatives."""
    assert len(got) == len(ids) and got[0] is None
    for entry, token, r in zip(got[1:], ids[1:], want):
        own = entry[str(token)]
        assert list(entry)[0] == str(token) and own["rank"] == r.rank and own["decoded_token"] == decode_one(token)
        assert own["logprob"] == pytest.approx(r.logprob, abs=1e-3)
        alts = {str(t): v for t, v in zip(r.top_ids, r.top_logprobs)}
        assert set(entry) == alts.keys() | {str(token)}  # k alternatives, the token not repeated among them
        assert sorted(e["rank"] for t, e in entry.items() if t in alts) == list(range(1, k + 1))
        assert all(entry[t]["logprob"] == pytest.approx(v, abs=1e-3) for t, v in alts.items())


def test_completion_prompt_logprobs_are_the_engines_and_leave_logprobs_as_asked(served, default_engine):
    tok = default_engine.tokenizer
    ids, decode_one = tok.encode(PROMPT), lambda t: tok.decode([t], skip_special_tokens=False)
    want = _engine_report(default_engine, ids, 3)
    assert any(r.rank > 3 for r in want)  # some prompt token is not among the alternatives: the test can tell
    status, body, _ = http(served.http, "/v1/completions",
                           {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "n": 2,
                            "prompt_logprobs": 3})
    assert status == 200, body
    for choice in body["choices"]:
        _check(choice["prompt_logprobs"], ids, want, 3, decode_one)
        assert choice["logprobs"] is None
    status, body, _ = http(served.http, "/v1/completions",
                           {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True,
                            "logprobs": 1, "prompt_logprobs": 3})
    assert status == 200, body
    _check(body["choices"][0]["prompt_logprobs"], ids, want, 3, decode_one)
    shown = body["choices"][0]["logprobs"]
    assert len(shown["tokens"]) == len(ids) + 3 and shown["top_logprobs"][0] is None
    assert all(1 <= len(t) <= 2 for t in shown["top_logprobs"][1:])  # logprobs=1: one alternative (+ the token)


def test_chat_prompt_logprobs_are_at_the_top_of_the_reply(served, default_engine):
    tok = default_engine.tokenizer
    ask = [{"role": "user", "content": "Name a large city."}]
    ids = tok.encode_chat([ChatMessage("user", "Name a large city.")])
    want = _engine_report(default_engine, ids, 0)
    status, body, _ = http(served.http, "/v1/chat/completions",
                           {"model": MODEL, "messages": ask, "max_tokens": 3, "temperature": 0, "logprobs": True,
                            "top_logprobs": 2, "prompt_logprobs": 0})
    assert status == 200, body
    _check(body["prompt_logprobs"], ids, want, 0, lambda t: tok.decode([t], skip_special_tokens=False))
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)  # the answer's own, as asked


@pytest.mark.parametrize("extra, says", [
    ({"prompt_logprobs": 1, "stream": True}, "not available when stream"),
    ({"prompt_logprobs": -1}, "whole vocabulary"),
    ({"prompt_logprobs": 21}, "[0, 20]"),
    ({"prompt_logprobs": "3"}, "integer"),
])
def test_prompt_logprobs_we_cannot_serve_are_a_400_naming_them(served, extra, says):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        status, reply, _ = http(served.http, path, {"model": MODEL, "max_tokens": 2} | body | extra)
        assert status == 400 and reply["error"]["param"] == "prompt_logprobs" and says in reply["error"]["message"]
