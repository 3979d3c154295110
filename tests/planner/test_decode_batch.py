"""Decode batching: bandwidth-bound vs compute-linear step times, and joining at the next step.

C closed-loop clients with equal requests move in lock step: their prompts share one prefill pass
(whose time is a constant), their first tokens come together and they decode in one batch of C. So
TPOT is exactly the step time for batch C, and output throughput is C * n tokens per round of
(prefill pass + (n - 1) steps).
"""

from __future__ import annotations

import pytest

from planner.sim.sim_layouts import Layout
from planner.sim.sim_metrics import summarize
from planner.sim.sim_run import simulate
from planner.plan_workload import RequestSpec
from tests.planner.toy import toy_profile

PASS = 0.05
OUT = 33


def _closed_loop(profile, clients: int) -> dict:
    specs = [RequestSpec(16, OUT, None)] * (4 * clients)
    run = simulate(profile, Layout("disaggregated", 1, 1), specs, concurrency=clients)
    return summarize(run.requests, profile.frontdoor, 1.0, 1.0)


def test_bandwidth_bound_step_keeps_tpot_and_doubles_throughput():
    step = 0.02
    profile = toy_profile(prefill={"intercept_s": PASS, "per_token_s": 0.0}, decode={"intercept_s": step})
    one, two = _closed_loop(profile, 8), _closed_loop(profile, 16)
    assert one["tpot_s"]["p50"] == pytest.approx(step) and one["tpot_s"]["p99"] == pytest.approx(step)
    assert two["tpot_s"]["p50"] == pytest.approx(step) and two["tpot_s"]["p99"] == pytest.approx(step)
    assert two["output_tokens_per_s"] == pytest.approx(2 * one["output_tokens_per_s"])
    assert one["output_tokens_per_s"] == pytest.approx(8 * OUT / (PASS + (OUT - 1) * step))


def test_compute_linear_step_grows_tpot():
    a, b = 0.01, 0.002
    profile = toy_profile(prefill={"intercept_s": PASS, "per_token_s": 0.0},
                          decode={"intercept_s": a, "per_sequence_s": b})
    one, two = _closed_loop(profile, 8), _closed_loop(profile, 16)
    assert one["tpot_s"]["p50"] == pytest.approx(a + 8 * b)
    assert two["tpot_s"]["p50"] == pytest.approx(a + 16 * b)
    ratio = two["output_tokens_per_s"] / one["output_tokens_per_s"]
    want = 2 * (PASS + (OUT - 1) * (a + 8 * b)) / (PASS + (OUT - 1) * (a + 16 * b))
    assert ratio == pytest.approx(want) and ratio < 2


def test_request_joins_at_the_first_step_after_its_kv_arrived():
    # A: prefill 0-0.1, decode steps end 0.3, 0.5, 0.7. B arrives at 0.25, its K/V at 0.35 (mid-step),
    # so its first decode step is the one starting at 0.5.
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.0}, decode={"intercept_s": 0.2})
    run = simulate(profile, Layout("disaggregated", 1, 1), [RequestSpec(10, 4, 0.0), RequestSpec(10, 2, 0.25)])
    a, b = run.requests
    assert a.token_times().tolist() == pytest.approx([0.1, 0.3, 0.5, 0.7])
    assert b.token_times().tolist() == pytest.approx([0.35, 0.7])
    assert run.pools[0].used == 0


def test_front_door_overhead_is_added_to_first_token_and_every_gap():
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.0}, decode={"intercept_s": 0.2},
                          frontdoor={"ttft_s": 0.003, "per_token_s": 0.001})
    run = simulate(profile, Layout("disaggregated", 1, 1), [RequestSpec(10, 4, 0.0)])
    s = summarize(run.requests, profile.frontdoor, 1.0, 1.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.103)
    assert s["tpot_s"]["p50"] == pytest.approx(0.201)
    assert s["e2e_s"]["p50"] == pytest.approx(0.7 + 0.003 + 3 * 0.001)
