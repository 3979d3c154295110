"""A prefill worker with a pool of its own runs a group of prompts as two passes: those it had room for
against their pages, then the others straight into their writers. When the second pass is given up (most
of its work left), the first one's prompts are answered with the token they computed, not computed again
(which would answer the token after it)."""

from __future__ import annotations

import time

import pytest

from tandem.sampling_params import SamplingParams
from tests.workers.test_handoff import BehindBlocker, worker_pair


@pytest.fixture
def pooled_pair(default_engine):
    """A prefill worker whose own pool has 2 pages (16 tokens each) and a decode worker."""
    with worker_pair(default_engine, prefill_pages=2) as workers:
        yield workers


def test_a_pooled_prompt_keeps_its_token_when_the_direct_pass_after_it_is_given_up(default_engine, pooled_pair):
    """"stay" (one page) gets the pool's room, "leave" (two pages) does not: they share a group, "stay"
    against its pages first, then "leave" into its writer. "leave" is aborted during its own pass, which
    is then given up; "stay" computed its first token in the pass before and is answered with it, exactly.
    (Each pass takes about 3 s.)"""
    prefill, decode = pooled_pair
    tpp = default_engine.tokens_per_page
    tok = default_engine.tokenizer
    prompts = {"blocker": tok.encode("Hello there."), "stay": tok.encode("One, two, three,"), "leave": tok.encode(
        "Tell me about the history of the Roman empire in detail, from its founding to its fall.")}
    assert len(prompts["stay"]) <= tpp < len(prompts["leave"]) <= 2 * tpp
    group = BehindBlocker(prefill, decode, prompts, SamplingParams(max_tokens=6), ["stay", "leave"])
    time.sleep(4.5)  # "stay"'s pass (~3 s from about 0.2 s) is done; "leave"'s is a few layers in
    prefill.abort("leave")
    assert group.sinks["leave"].finished.wait(30)
    group.check_answer(default_engine, "stay")
