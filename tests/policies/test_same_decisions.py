"""The planner's simulator makes the serving code's decisions: the same policies (policies/) drive
both, and here both run side by side on the same requests and must choose the same passes.

- A co-located engine: the real Scheduler over the real model against planner/sim/colocated.py, in
  both batching policies; every pass is recorded as (prompt chunks, decode rows).
- A prefill worker: the real PrefillWorker (real model, no destination) against
  planner/sim/sim_prefill.py, short and long prompts mixed; every pass is recorded as its chunks.
Both first come, first served and with priorities (the requests' own, as `priority` in a request).
- The victim of a preemption: the real WaitingRoom against planner/sim/waiting.py's Holders.
- The policy functions' own contracts, over many generated queues (hypothesis).
"""

from __future__ import annotations

import random
from contextlib import ExitStack

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control.fleet import Fleet
from control.waiting_room import WaitingRoom
from engine.scheduler import Scheduler
from engine.workers.prefill_worker import PrefillWorker
from planner.sim.colocated import ColocatedSim
from planner.sim.events import EventLoop
from planner.sim.pages import PagePool
from planner.sim.request import SimRequest
from planner.sim.sim_prefill import Link, PrefillSim
from planner.sim.waiting import Holders
from policies.batching import admit, chunk_split
from policies.prefill_passes import PassTurn, chunk_tokens, in_turn, next_long, pack
from tandem.sampling_params import SamplingParams
from tandem.wire import Prefill

# (prompt tokens, output tokens) of each request, all arriving at once
REQUESTS = [(37, 3), (5, 6), (90, 2), (12, 4), (12, 2), (60, 5), (8, 3)]
# each request's priority: all equal (first come, first served), or classes out of arrival order
ORDERS = {"fcfs": [0] * 9, "priorities": [2, 0, 1, 0, 2, -1, 1, 0, 2]}


class RecordingCosts:
    """The simulator's pass prices (input to it, not the thing tested): constant, and every pass asked
    for is recorded as (prompt chunks, decode rows)."""

    def __init__(self):
        self.passes: list[tuple[list[tuple[int, int]], int]] = []

    def prefill_time(self, chunks):
        self.passes.append((list(chunks), 0))
        return 1.0

    def decode_time(self, batch, context_tokens):
        self.passes.append(([], batch))
        return 1.0

    def mixed_time(self, chunks, batch, context_tokens):
        self.passes.append((list(chunks), batch))
        return 1.0


def simulated(pass_tokens: int, max_batch: int, chunk: int | None, priorities: list[int]):
    loop, costs = EventLoop(), RecordingCosts()
    sim = ColocatedSim(loop, costs, PagePool(10_000, 16), pass_tokens=pass_tokens, max_batch=max_batch,
                       chunk_tokens=chunk, on_done=lambda r: None)
    for i, (p, o) in enumerate(REQUESTS):
        sim.open(SimRequest(i, p, o, priority=priorities[i]))
    loop.run()
    return costs.passes


def real(engine, pass_tokens: int, max_batch: int, chunk: int | None, priorities: list[int]):
    sched = Scheduler(engine, max_batch_size=max_batch, pass_tokens=pass_tokens, chunk_tokens=chunk)
    seqs = []
    for i, (p, o) in enumerate(REQUESTS):
        params = SamplingParams(max_tokens=o, ignore_eos=True, priority=priorities[i])
        seq = engine.new_sequence(f"r{i}", list(range(200, 200 + p)), params)
        engine.admit(seq)
        sched.add_prefill(seq)
        seqs.append(seq)
    passes = []
    while sched.has_work:
        before = {s: s.num_cached for s in sched.waiting}
        rows = len(sched.running)
        events = sched.step()
        chunks = [(done, (s.num_cached if s in sched.waiting else len(s.prompt_ids)) - done)
                  for s, done in before.items() if s not in sched.waiting or s.num_cached > done]
        decoded = rows if chunk is not None or not chunks else 0
        passes.append((chunks, decoded))
        for ev in events:
            if ev.seq.finished:
                engine.release(ev.seq)
    assert engine.allocator.num_used == 0
    return passes


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("pass_tokens,max_batch,chunk", [(64, 3, None), (128, 8, None), (64, 4, 24), (512, 3, 50)])
def test_scheduler_and_simulator_choose_the_same_passes(default_engine, pass_tokens, max_batch, chunk, order):
    got = real(default_engine, pass_tokens, max_batch, chunk, ORDERS[order])
    assert got == simulated(pass_tokens, max_batch, chunk, ORDERS[order])
    assert any(c for c, _ in got) and any(r for _, r in got)  # both kinds of work happened


PROMPTS = [30, 150, 12, 7, 40, 100, 21, 25, 9]  # prompt tokens, all distinct (a chunk names its prompt)


class Answers:
    """The Responder a prefill worker answers into (counts answers; nobody leaves)."""

    def __init__(self):
        self.answers = 0

    def send(self, body, final=False):
        self.answers += 1

    def fail(self, error):
        raise AssertionError(f"prefill failed: {error}")

    def cancelled(self):
        return False

    def done(self):
        return self.answers > 0


@pytest.mark.parametrize("order", ORDERS)
def test_prefill_worker_and_simulator_choose_the_same_passes(default_engine, order):
    pass_tokens, tpp, priorities = 64, default_engine.cache.layout.tokens_per_page, ORDERS[order]
    worker = PrefillWorker(default_engine, pass_tokens=pass_tokens)  # its loop not started: we step it
    rng = random.Random(f"prompts {order}")  # the engine is shared: other prompts than another order's run
    for i, n in enumerate(PROMPTS):  # random ids: no prompt shares a cached prefix with another
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        worker.submit(Prefill(f"r{i}", ids, SamplingParams(max_tokens=1, priority=priorities[i])), Answers())
    lengths = [it.seq.num_tokens for it in worker.queue]  # as the engine counts them

    loop, costs = EventLoop(), RecordingCosts()
    sim = PrefillSim(loop, costs, Link(1.0, 0.0), pass_tokens=pass_tokens, tokens_per_page=tpp,
                     kv_bytes_per_token=1, on_ready=lambda r: None)
    for i, n in enumerate(lengths):
        sim.submit(SimRequest(i, n, 1, priority=priorities[i]))
    loop.run()
    want = [sorted(chunks) for chunks, _ in costs.passes]

    got = []
    while worker.queue:
        before = {it: (it.seq.num_cached, it.seq.num_tokens) for it in worker.queue}
        assert worker.step()
        after = {it: it.seq.num_cached for it in worker.queue}
        got.append(sorted((done, (after[it] if it in after else total) - done)
                          for it, (done, total) in before.items() if it not in after or after[it] > done))
    worker.close()
    assert got == want
    assert any(s > 0 for p in got for s, _ in p) and any(len(p) > 1 for p in got)  # chunks and packed passes
    assert default_engine.allocator.num_used == 0


sizes = st.lists(st.integers(1, 300), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(sizes, st.integers(1, 600))
def test_pack_takes_the_oldest_then_the_shortest_that_fit(queue, budget):
    idx = list(range(len(queue)))
    group = pack(idx, lambda i: queue[i], budget)
    assert group[0] == 0 and len(set(group)) == len(group)
    assert len(group) == 1 or sum(queue[i] for i in group) <= budget
    left = budget - sum(queue[i] for i in group)
    assert all(queue[i] > left for i in idx if i not in group)  # nothing left out would still fit...
    others = [queue[i] for i in group[1:]]
    assert others == sorted(others)  # ...because the shortest were taken first


@settings(max_examples=300, deadline=None)
@given(sizes, st.integers(1, 600), st.lists(st.integers(-2, 2), min_size=12, max_size=12))
def test_with_priorities_the_most_urgent_oldest_goes_first_and_fillers_go_by_priority(queue, budget, prio):
    arrived = list(range(len(queue)))
    waiting = in_turn(arrived, lambda i: prio[i])
    assert [prio[i] for i in waiting] == sorted(prio[:len(queue)])  # lowest value first...
    assert all(a < b for a, b in zip(waiting, waiting[1:]) if prio[a] == prio[b])  # ...arrival order among equals
    group = pack(waiting, lambda i: queue[i], budget, lambda i: prio[i])
    assert group[0] == waiting[0] and len(set(group)) == len(group)
    assert len(group) == 1 or sum(queue[i] for i in group) <= budget
    left = budget - sum(queue[i] for i in group)
    assert all(queue[i] > left for i in arrived if i not in group)  # nothing left out would still fit
    fillers = [(prio[i], queue[i]) for i in group[1:]]
    assert fillers == sorted(fillers)  # by priority, the shortest first within one
    if len(set(prio[:len(queue)])) == 1:  # all equal: exactly first come, first served
        assert waiting == arrived and group == pack(arrived, lambda i: queue[i], budget)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 2), st.booleans()), min_size=1, max_size=12))
def test_a_long_prompt_part_way_through_keeps_its_turn_else_the_first_in_turn_goes(longs):
    idx = list(range(len(longs)))
    chosen = next_long(idx, lambda i: longs[i][0], lambda i: longs[i][1])
    started = [i for i in idx if longs[i][1]]
    want = in_turn(started or idx, lambda i: longs[i][0])[0]
    assert chosen == want


@settings(max_examples=300, deadline=None)
@given(sizes, st.integers(1, 600), st.integers(0, 15))
def test_admit_is_an_in_order_prefix_within_room_and_budget(queue, budget, room):
    n = admit(queue, lambda x: x, budget, room)
    assert n <= min(room, len(queue))
    assert n == 0 or n == 1 or sum(queue[:n]) <= budget
    if 0 < n < min(room, len(queue)):
        assert sum(queue[:n + 1]) > budget  # stopped only because the next did not fit
    if room > 0:
        assert n >= 1  # the oldest always goes when there is room


@settings(max_examples=300, deadline=None)
@given(sizes, st.integers(1, 600))
def test_chunk_split_spends_the_budget_in_order(todo, budget):
    got = chunk_split(todo, budget)
    assert sum(got) <= budget and all(0 < g <= t for g, t in zip(got, todo))
    assert sum(got) == min(budget, sum(todo[:len(got)])) and (sum(got) == budget or len(got) == len(todo))


def test_pass_turn_alternates_only_while_both_wait():
    turn = PassTurn()
    assert [turn.take_long(True, True) for _ in range(4)] == [False, True, False, True]
    assert turn.take_long(True, False) and turn.take_long(True, False)  # only longs: always long
    assert not turn.take_long(False, True)
    assert chunk_tokens(100, 16) == 96 and chunk_tokens(10, 16) == 16


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), max_size=12), st.integers(-1, 3),
       st.integers(0, 2))
def test_the_waiting_room_and_the_simulator_preempt_the_same_request(held, priority, refused_by):
    """`held`: (priority, worker) of each request holding pages, in arrival order. A request of `priority`
    refused by worker `refused_by`: the real WaitingRoom and the simulator's Holders pick one victim."""
    room, holders, workers = WaitingRoom(Fleet()), Holders(), [object() for _ in range(3)]
    with ExitStack() as stack:
        seats = []
        for i, (p, w) in enumerate(held):
            seats.append(stack.enter_context(room.visit(str(i), p)))
            seats[-1].take(f"decode-{w}", lambda: True)
            holders.add(SimRequest(i, 10, 1, arrival=float(i), priority=p), workers[w])
        victim = holders.least_urgent(priority, workers[refused_by])
        assert room.make_room(priority, f"decode-{refused_by}") == (victim is not None)
        assert [i for i, s in enumerate(seats) if s.preempted] == ([victim.index] if victim is not None else [])
