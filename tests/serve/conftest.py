"""Fixtures the served-stack tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def openai_client(served):
    """The official `openai` SDK against the session's `tandem serve` (no retries: a refusal is seen as sent)."""
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=served.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="session")
def templated(built_engines, tmp_path_factory):
    """`tandem serve` with a tool-aware chat template (tests/serve/templated.py) and the hermes tool-call
    parser: the `openai` SDK against it, and the template's path."""
    yield from _templated(built_engines, tmp_path_factory, "hermes")


@pytest.fixture(scope="module", params=["llama3_json", "pythonic", "mistral"])
def templated_whole(request, built_engines, tmp_path_factory):
    """The same stack with a tool-call parser whose calls are (or may be) the whole answer: (parser name,
    the SDK, the template's path)."""
    for c, template, _ in _templated(built_engines, tmp_path_factory, request.param):
        yield request.param, c, template


def _templated(built_engines, tmp_path_factory, parser: str):
    from tests.conftest import start_serve, stop_serve
    from tests.serve.templated import write_template

    openai = pytest.importorskip("openai")
    work = tmp_path_factory.mktemp(f"serve-templated-{parser}")
    template = write_template(work)
    s = start_serve(built_engines, work, "--chat-template", template, "--tool-call-parser", parser)
    c = openai.OpenAI(base_url=s.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c, template, s
    c.close()
    stop_serve(s)
