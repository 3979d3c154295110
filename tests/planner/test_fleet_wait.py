"""Full pools: a request waits in the orchestrator for any replica or decode worker to free pages,
and retries on whichever has them (control/serving_path.py), not in one worker's queue."""

from __future__ import annotations

import pytest

from planner.sim.sim_layouts import Layout
from planner.sim.sim_run import simulate
from planner.sim.waiting import RETRY_DELAY_S
from planner.plan_workload import RequestSpec
from tests.planner.toy import toy_profile


def test_a_waiting_request_goes_to_the_replica_that_frees_pages_first():
    # Two replicas, each with a 7-page pool; every request needs 7 pages (100 + 12 tokens), so each
    # replica holds one. A (12 tokens out) on replica 0 finishes long after B (2 out) on replica 1;
    # C, which found both full, must run on replica 1 as soon as B is done.
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.01}, decode={"intercept_s": 0.2},
                          serving={"kv_pool_bytes": 7 * 16 * 1000})
    specs = [RequestSpec(100, 12, 0.0), RequestSpec(100, 12, 0.0), RequestSpec(100, 12, 0.0)]
    specs[1] = RequestSpec(100, 2, 0.0)
    run = simulate(profile, Layout("colocated", 2), specs)
    a, b, c = run.requests
    assert a.first_token == pytest.approx(1.1) and b.first_token == pytest.approx(1.1)
    assert b.done_at == pytest.approx(1.3)
    assert c.reserved_at == pytest.approx(1.3 + RETRY_DELAY_S)  # on replica 1, idle again: it starts at once
    assert c.first_token == pytest.approx(1.3 + RETRY_DELAY_S + 1.1)
    assert a.done_at == pytest.approx(1.1 + 11 * 0.2)  # replica 0 never saw C
    assert run.system.engines[1].pool.peak == 7 and run.system.engines[0].pool.peak == 7


def test_disaggregated_requests_wait_for_any_decode_worker_without_head_of_line_blocking():
    # One decode worker with 10 pages. A holds 7; B (7 pages) waits; C (1 page) is reserved at once.
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.01}, decode={"intercept_s": 0.2},
                          serving={"kv_pool_bytes": 10 * 16 * 1000})
    specs = [RequestSpec(100, 4, 0.0), RequestSpec(100, 4, 0.0), RequestSpec(10, 2, 0.0)]
    a, b, c = simulate(profile, Layout("disaggregated", 1, 1), specs).requests
    assert a.reserved_at == 0.0 and c.reserved_at == 0.0
    assert b.reserved_at == pytest.approx(a.done_at + RETRY_DELAY_S)
