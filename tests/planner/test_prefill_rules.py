"""The simulated schedulers' pass rules, on tiny traces whose timelines are computed by hand."""

from __future__ import annotations

import pytest

from planner.sim.sim_layouts import Layout
from planner.sim.sim_run import simulate
from planner.sim.waiting import RETRY_DELAY_S
from planner.plan_workload import RequestSpec
from tests.planner.toy import toy_profile

ONE_BY_ONE = Layout("disaggregated", 1, 1)


def _first_tokens(run) -> list[float]:
    return [r.first_token for r in run.requests]


def test_packed_pass_takes_the_oldest_then_the_shortest_that_fit():
    # budget 100: A (60, oldest), then the shortest others: D (10), C (30) -> 100 tokens; B (50) waits.
    profile = toy_profile(prefill={"intercept_s": 1.0, "per_token_s": 0.01}, serving={"pass_tokens": 100})
    specs = [RequestSpec(n, 1, 0.0) for n in (60, 50, 30, 10)]  # A, B, C, D
    run = simulate(profile, ONE_BY_ONE, specs)
    assert _first_tokens(run) == pytest.approx([2.0, 3.5, 2.0, 2.0])  # pass 1: 1 + 1.0; pass 2: 1 + 0.5
    assert run.system.prefill[0].passes == 2


def test_long_prompt_is_chunked_and_alternates_with_short_ones():
    # pass_tokens 70 -> chunks of 64 (a multiple of 16 tokens per page). t = 0.1 + 0.01 n + 1e-4 * attention.
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.01, "per_attention_s": 1e-4},
                          serving={"pass_tokens": 70})
    specs = [RequestSpec(150, 1, 0.0), RequestSpec(20, 1, 0.0), RequestSpec(20, 1, 0.5)]  # L, S1, S2
    run = simulate(profile, ONE_BY_ONE, specs)
    s1 = 0.1 + 0.2 + 1e-4 * 20 ** 2  # 0.34: shorts go first
    c1 = 0.1 + 0.64 + 1e-4 * 64 ** 2  # L's chunk [0, 64)
    s2 = s1  # S2 arrived at 0.5, during c1: its turn comes next
    c2 = 0.1 + 0.64 + 1e-4 * (128 ** 2 - 64 ** 2)  # chunk [64, 128) attends to its 64 predecessors too
    c3 = 0.1 + 0.22 + 1e-4 * (150 ** 2 - 128 ** 2)  # the last 22 tokens
    long_, short1, short2 = run.requests
    assert short1.first_token == pytest.approx(s1)
    assert long_.prefill_start == pytest.approx(s1)
    assert short2.first_token == pytest.approx(s1 + c1 + s2)
    assert long_.first_token == pytest.approx(s1 + c1 + s2 + c2 + c3)
    assert run.system.prefill[0].passes == 5


def test_handoff_tail_is_what_the_pass_did_not_hide_plus_latency():
    # 100 tokens * 1 MB at 0.1 GB/s = 1.0 s of transfer; passes of 0.4 s (alone) and 1.5 s.
    handoff = {"gbytes_per_s": 0.1, "latency_s": 0.01}
    model = {"kv_bytes_per_token": 1_000_000}
    short = toy_profile(prefill={"intercept_s": 0.4, "per_token_s": 0.0}, handoff=handoff, model=model)
    run = simulate(short, ONE_BY_ONE, [RequestSpec(100, 1, 0.0)])
    assert _first_tokens(run) == pytest.approx([0.4 + (1.0 - 0.4) + 0.01])
    long_pass = toy_profile(prefill={"intercept_s": 1.5, "per_token_s": 0.0}, handoff=handoff, model=model)
    run = simulate(long_pass, ONE_BY_ONE, [RequestSpec(100, 1, 0.0)])
    assert _first_tokens(run) == pytest.approx([1.5 + 0.01])


def test_colocated_prefill_first_pauses_decodes():
    # prefill 0.1 + 0.01/token; decode 0.2 per step. A (30 tokens, 3 out) at 0; B (30, 2 out) at 0.05.
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.01}, decode={"intercept_s": 0.2},
                          serving={"pass_tokens": 100})
    run = simulate(profile, Layout("colocated", 1), [RequestSpec(30, 3, 0.0), RequestSpec(30, 2, 0.05)])
    a, b = run.requests
    # A's prefill ends 0.4; B's prefill (0.4-0.8) comes before A's first decode step (a stall);
    # then one step for both (0.8-1.0) and one for A alone (1.0-1.2).
    assert a.token_times().tolist() == pytest.approx([0.4, 1.0, 1.2])
    assert b.token_times().tolist() == pytest.approx([0.8, 1.0])


def test_colocated_pass_budget():
    # budget 50: A (30) and B (30) do not share a pass; B and C (10) do (40 tokens: 0.1 + 0.4).
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.01}, serving={"pass_tokens": 50})
    run = simulate(profile, Layout("colocated", 1), [RequestSpec(n, 1, 0.0) for n in (30, 30, 10)])
    assert _first_tokens(run) == pytest.approx([0.4, 0.9, 0.9])


def test_colocated_open_reserves_at_once_or_waits_outside_and_retries_after_a_free():
    # A pool of 10 pages of 16 tokens. R1 and R2 need 7 pages each (100 + 4 tokens), R3 one page (10 + 6).
    # R2 gets OUT_OF_PAGES and waits in the orchestrator; R3 fits and opens at once (no head-of-line
    # blocking), sharing R1's pass (110 tokens: 0.1 + 1.1 s).
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.01}, decode={"intercept_s": 0.2},
                          serving={"kv_pool_bytes": 10 * 16 * 1000})
    specs = [RequestSpec(100, 4, 0.0), RequestSpec(100, 4, 0.0), RequestSpec(10, 6, 0.0)]
    run = simulate(profile, Layout("colocated", 1), specs)
    r1, r2, r3 = run.requests
    assert r1.reserved_at == 0.0 and r3.reserved_at == 0.0
    assert r1.token_times().tolist() == pytest.approx([1.2, 1.4, 1.6, 1.8])  # its pages free at 1.8
    # R2 retries one round trip after the free; the engine has already begun R3's next step (1.8-2.0),
    # so R2's prefill (2.0-3.1) comes after it, and R3's last token after that pass.
    assert r2.reserved_at == pytest.approx(1.8 + RETRY_DELAY_S)
    assert r2.token_times().tolist() == pytest.approx([3.1, 3.3, 3.5, 3.7])
    assert r3.token_times().tolist() == pytest.approx([1.2, 1.4, 1.6, 1.8, 2.0, 3.3])
    assert run.system.wait.retries == 0 and not run.system.wait.waiting  # the one retry, after R1's free, got them


def test_chunked_steps_mix_prompt_chunks_into_decode_steps():
    # chunk 20; prefill 0.1 + 0.01/token; decode 0.2. A (30, 2 out) and B (10, 2 out) at 0; C (10, 2) at 0.6.
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.01}, decode={"intercept_s": 0.2},
                          serving={"chunk_tokens": 20})
    specs = [RequestSpec(30, 2, 0.0), RequestSpec(10, 2, 0.0), RequestSpec(10, 2, 0.6)]
    run = simulate(profile, Layout("chunked", 1), specs)
    a, b, c = run.requests
    # step 1 (0-0.3): A[0,20); step 2 (0.3-0.6): A[20,30) + B[0,10): both first tokens at 0.6.
    # step 3 (0.6-0.9): decode A, B + C's 10 tokens: one fixed cost max(0.1, 0.2) + 0.1 = 0.3.
    # step 4 (0.9-1.1): decode C.
    assert a.token_times().tolist() == pytest.approx([0.6, 0.9])
    assert b.token_times().tolist() == pytest.approx([0.6, 0.9])
    assert c.token_times().tolist() == pytest.approx([0.9, 1.1])
