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
