"""Serving the model under several OpenAI ids (`--served-model-name` repeated, or its variable's
space-separated names, as vLLM's): on a real 1P1D stack, /v1/models lists each, a request may name any
of them (or the Triton name) and its answer carries the first; another name is a 404 listing those
served. Names that cannot be served stop the start in one line."""

from __future__ import annotations

import pytest

from tests.conftest import start_serve, stop_serve
from tests.serve.test_door_conformance import http
from tests.serve.test_startup_errors import one_error_line, run

openai = pytest.importorskip("openai")

NAMES = ["gpt-4o-mini", "tiny-chat"]


@pytest.fixture(scope="module")
def named(built_engines, tmp_path_factory):
    """The stack, and the `openai` SDK against it."""
    s = start_serve(built_engines, tmp_path_factory.mktemp("serve-named"),
                    env={"TANDEM_SERVED_MODEL_NAME": " ".join(NAMES)})
    try:
        with openai.OpenAI(base_url=s.http + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield s, c
    finally:
        stop_serve(s)


def test_every_name_is_listed_and_answers_carry_the_first(named):
    serve, client = named
    assert [m.id for m in client.models.list()] == NAMES
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    assert client.models.retrieve("ensemble").id == NAMES[0]  # the Triton name's card is the served one's
    ask = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0}
    answers = [client.chat.completions.create(model=name, **ask) for name in (*NAMES, "ensemble")]
    assert {a.model for a in answers} == {NAMES[0]}
    assert len({a.choices[0].message.content for a in answers}) == 1  # one model, whichever name
    done = client.responses.create(model="tiny-chat", input="Name a colour.", max_output_tokens=4, temperature=0)
    assert done.model == NAMES[0]
    status, reply, _ = http(serve.http, "/tokenize", {"model": "tiny-chat", "prompt": "Hello"})
    assert status == 200 and reply["tokens"], reply


def test_another_name_is_a_404_listing_those_served(named):
    _, client = named
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2)
    assert "'gpt-4o-mini' or 'tiny-chat' or 'ensemble'" in e.value.body["message"], e.value.body
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("smollm2-135m")


@pytest.mark.parametrize("names", [["a", "a"], ["a", ""]])
def test_names_that_cannot_be_served_are_one_line(built_engines, names):
    code, err = run("serve", "--model", str(built_engines),
                    *[arg for n in names for arg in ("--served-model-name", n)])
    line = one_error_line(err)
    assert code != 0 and "front_door.served_model_name must be distinct non-empty names" in line, line
