"""vLLM's prompt options, each answer exactly the engine's on the prompt ids the option says:
`truncate_prompt_tokens` keeps the prompt's last k tokens (echo shows those, usage counts them);
`chat_template_kwargs` reach the chat template (answers and /tokenize); `add_special_tokens` lets the
tokenizer add its BOS (text prompts: yes, chats: no, unless said). Beam search and template variables
the request sets itself are 400s naming the field."""

from __future__ import annotations

import json
import shutil

import pytest

from control.requests import GenerationRequest, Limits, prepare
from engine.checkpoint import resolve
from engine.tokenizer import ChatMessage, Tokenizer
from tandem.sampling_params import SamplingParams
from tests.conftest import complete
from tests.serve.templated import templated_ids
from tests.serve.test_door_conformance import http

MODEL = "smollm2-135m"
LONG = ("The keeper of the lighthouse on the northern island wrote in his log every night: the wind, the "
        "ships that passed, and the colour of the sea at dusk. One winter evening he wrote")


def _greedy(engine, ids: list[int], n: int) -> str:
    return engine.tokenizer.decode(complete(engine, ids, SamplingParams(max_tokens=n)).output_ids)


def test_truncate_prompt_tokens_answers_the_prompts_last_tokens(openai_client, default_engine):
    ids = default_engine.tokenizer.encode(LONG)
    assert len(ids) > 16
    want = _greedy(default_engine, ids[-8:], 12)
    assert want != _greedy(default_engine, ids, 12)  # the cut changes the answer: the test can tell
    kw = dict(model=MODEL, prompt=LONG, max_tokens=12, temperature=0)
    got = openai_client.completions.create(**kw, extra_body={"truncate_prompt_tokens": 8})
    assert got.choices[0].text == want and got.usage.prompt_tokens == 8
    echoed = openai_client.completions.create(**kw, echo=True, extra_body={"truncate_prompt_tokens": 8})
    assert echoed.choices[0].text == default_engine.tokenizer.decode(ids[-8:]) + want  # the prompt it answered
    whole = openai_client.completions.create(**kw, extra_body={"truncate_prompt_tokens": -1})  # the context: no cut
    assert whole.choices[0].text == _greedy(default_engine, ids, 12) and whole.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("extra, param, says", [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
    ({"truncate_prompt_tokens": "8"}, "truncate_prompt_tokens", "integer"),
    ({"use_beam_search": True}, "use_beam_search", "beam search is not supported"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set messages"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "an object"),
    ({"add_special_tokens": "yes"}, "add_special_tokens", "boolean"),
    ({"priority": 1}, "priority", "first come, first served"),
    ({"priority": "high"}, "priority", "integer"),
    ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens", "boolean"),
    ({"cache_salt": ""}, "cache_salt", "non-empty string"),
    ({"cache_salt": 7}, "cache_salt", "non-empty string"),
    ({"cache_salt": "s" * 257}, "cache_salt", "at most 256 characters"),
])
def test_a_prompt_option_we_cannot_honour_is_a_400_naming_it(served, extra, param, says):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4} | extra
    status, reply, _ = http(served.http, "/v1/chat/completions", body)
    assert status == 400 and reply["error"]["param"] == param and says in reply["error"]["message"], reply


def test_the_responses_door_carries_a_priority_as_chat_does(served):
    status, reply, _ = http(served.http, "/v1/responses", {"input": "Hi", "max_output_tokens": 4, "priority": 1})
    assert status == 400 and reply["error"]["param"] == "priority" and "first come, first served" in \
        reply["error"]["message"], reply
    status, reply, _ = http(served.http, "/v1/responses", {"input": "Hi", "max_output_tokens": 4, "priority": 0})
    assert status == 200 and reply["object"] == "response", reply  # 4 tokens: "incomplete", as asked


def test_vllms_no_effect_fields_are_accepted_as_vllm_accepts_them(served, default_engine):
    """priority 0 and spaces_between_special_tokens (vLLM applies it with slow tokenizers only) change no
    token, and are not "unknown" (the server names those in its log)."""
    body = {"prompt": LONG, "max_tokens": 8, "temperature": 0}
    status, plain, _ = http(served.http, "/v1/completions", body)
    status2, same, _ = http(served.http, "/v1/completions",
                            body | {"priority": 0, "spaces_between_special_tokens": False})
    assert status == status2 == 200 and same["choices"][0]["text"] == plain["choices"][0]["text"]
    with open(served.log_path) as f:
        assert not any("'priority'" in line or "'spaces_between_special_tokens'" in line for line in f)


def test_chat_template_kwargs_reach_the_template(templated, default_engine, built_engines):
    client, template, stack = templated
    ask = [{"role": "user", "content": "Name a large city."}]
    plain, quiet = templated_ids(built_engines, template, ask), templated_ids(built_engines, template, ask,
                                                                               enable_thinking=False)
    assert plain != quiet  # the template writes " /no_think" when told
    kw = dict(model=MODEL, messages=ask, max_tokens=12, temperature=0)
    got = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert got.choices[0].message.content == _greedy(default_engine, quiet, 12)
    assert got.usage.prompt_tokens == len(quiet)
    status, body, _ = http(stack.http, "/tokenize",
                           {"messages": ask, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and body["tokens"] == quiet, body


def test_documents_reach_the_template(templated, default_engine, built_engines):
    """vLLM's `documents`: the template's variable of that name (chat and /tokenize alike); a
    `chat_template_kwargs` entry of the same name wins, as in vLLM."""
    client, template, stack = templated
    ask = [{"role": "user", "content": "When did the river flood?"}]
    docs = [{"title": "Town ledger", "text": "The river flooded in the spring of 1911."}]
    plain, shown = templated_ids(built_engines, template, ask), templated_ids(built_engines, template, ask,
                                                                              documents=docs)
    assert len(shown) > len(plain) + 10  # the template shows the documents
    kw = dict(model=MODEL, messages=ask, max_tokens=12, temperature=0)
    got = client.chat.completions.create(**kw, extra_body={"documents": docs})
    assert got.choices[0].message.content == _greedy(default_engine, shown, 12)
    assert got.usage.prompt_tokens == len(shown)
    status, body, _ = http(stack.http, "/tokenize", {"messages": ask, "documents": [{"title": "x", "text": "y"}],
                                                     "chat_template_kwargs": {"documents": docs}})
    assert status == 200 and body["tokens"] == shown, body
    status, body, _ = http(stack.http, "/v1/chat/completions", kw | {"documents": [{"title": 1911}]})
    assert status == 400 and body["error"]["param"] == "documents", body


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    """The default model's tokenizer.json with a post-processor that adds a BOS (<|im_start|>), as many
    models' do (SmolLM2's adds none)."""
    folder = tmp_path_factory.mktemp("bos-tokenizer")
    src = resolve(MODEL).folder
    with open(f"{src}/tokenizer.json", encoding="utf-8") as f:
        spec = json.load(f)
    bos = next(t for t in spec["added_tokens"] if t["content"] == "<|im_start|>")
    start, seq = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [start, seq], "pair": [start, seq],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [bos["id"]],
                                                                  "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copyfile(f"{src}/tokenizer_config.json", folder / "tokenizer_config.json")
    return Tokenizer(str(folder)), bos["id"]


def test_add_special_tokens_gives_a_text_prompt_its_bos_and_a_chat_none_unless_asked(bos_tokenizer):
    tok, bos = bos_tokenizer
    limits = Limits(max_context=2048, vocab_size=tok.vocab_size)
    ids = lambda **kw: prepare(GenerationRequest("r", max_tokens=1, **kw), tok, limits).prompt_ids  # noqa: E731
    text = tok.encode("Hello there", add_special_tokens=False)
    assert ids(prompt="Hello there") == [bos, *text]  # a text prompt: the tokenizer's BOS, as vLLM
    assert ids(prompt="Hello there", add_special_tokens=False) == text
    chat = tok.encode_chat([ChatMessage("user", "Hi")])
    assert chat[0] == bos and chat[1] != bos  # the template writes <|im_start|> itself ...
    assert ids(messages=(ChatMessage("user", "Hi"),)) == chat  # ... so a chat gets no second one
    assert ids(messages=(ChatMessage("user", "Hi"),), add_special_tokens=True) == [bos, *chat]
