"""Co-located batching policies give the same greedy tokens as prefill + decode done by hand."""

from __future__ import annotations

import pytest

from tandem.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import ChatMessage
from tests.conftest import complete

PROMPTS = ["Hi", "What is the capital of France?", "Write a long poem about the sea and the wind. " * 6,
           "List the days of the week."]


@pytest.mark.parametrize("chunk", [None, 7, 64])
def test_scheduler_matches_direct_greedy_with_late_arrivals(default_engine, chunk):
    ids = [default_engine.tokenizer.encode_chat([ChatMessage("user", p)]) for p in PROMPTS]
    want = [complete(default_engine, x, SamplingParams(max_tokens=12)).output_ids for x in ids]
    sched = Scheduler(default_engine, max_batch_size=8, pass_tokens=4096, chunk_tokens=chunk)
    seqs = [default_engine.new_sequence(f"r{i}", x, SamplingParams(max_tokens=12)) for i, x in enumerate(ids)]

    def add(seq):
        default_engine.admit(seq)
        sched.add_prefill(seq)

    add(seqs[0])
    add(seqs[1])
    steps = 0
    while sched.has_work:
        for ev in sched.step():
            if ev.seq.finished:
                default_engine.release(ev.seq)
        steps += 1
        if steps == 3:  # the rest arrive while the first ones decode
            add(seqs[2])
            add(seqs[3])
    assert [s.output_ids for s in seqs] == want
    assert default_engine.allocator.num_used == 0


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompts_wait_by_priority_then_arrival_and_their_tokens_do_not_change(default_engine, chunk):
    """With room for one sequence at a time, prompts are computed lowest priority value first, arrivals in
    order among equals; each answer is the one it gets alone (a priority changes no token)."""
    ids = [default_engine.tokenizer.encode_chat([ChatMessage("user", p)]) for p in PROMPTS]
    priorities = [3, 0, -1, 0]
    params = [SamplingParams(max_tokens=4, priority=p) for p in priorities]
    want = [complete(default_engine, x, SamplingParams(max_tokens=4)).output_ids for x in ids]
    sched = Scheduler(default_engine, max_batch_size=1, pass_tokens=4096, chunk_tokens=chunk)
    seqs = [default_engine.new_sequence(f"r{i}", x, p) for i, (x, p) in enumerate(zip(ids, params))]
    for seq in seqs:
        default_engine.admit(seq)
        sched.add_prefill(seq)
    assert [s.request_id for s in sched.waiting] == ["r2", "r1", "r3", "r0"]
    finished = []
    while sched.has_work:
        for ev in sched.step():
            if ev.seq.finished:
                finished.append(ev.seq.request_id)
                default_engine.release(ev.seq)
    assert finished == ["r2", "r1", "r3", "r0"]
    assert [s.output_ids for s in seqs] == want
    assert default_engine.allocator.num_used == 0
