"""Validation against measured runs: the simulator replays exactly what a benchmark sent."""

from __future__ import annotations

import pytest

from planner.sim.sim_layouts import Layout
from planner.validate import TARGETS, Sent, compare, for_deployment, predict
from tests.planner.toy import toy_profile


def test_replay_uses_the_send_times_and_lengths_given():
    # prefill 0.1 + 0.01/token, decode 0.2 per step, front door +0.05 s on the first token.
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.01}, decode={"intercept_s": 0.2},
                          frontdoor={"ttft_s": 0.05, "per_token_s": 0.0})
    # sent 10 s into a run: times are taken relative to the first send
    sent = [Sent(10.0, 30, 3), Sent(12.0, 20, 2)]
    s = predict(profile, Layout("colocated", 1), sent, slo_ttft_s=0.4, slo_tpot_s=0.25)
    # A: pass 0-0.4, steps 0.4-0.6-0.8. B (at 2.0): pass 2.0-2.3, one step 2.3-2.5
    assert s["ttft_s"]["p50"] == pytest.approx((0.45 + 0.35) / 2)
    assert s["itl_s"]["p50"] == pytest.approx(0.2)
    assert s["slo_attainment"] == pytest.approx(0.5)  # A's TTFT 0.45 misses 0.4; B meets both
    with pytest.raises(ValueError, match="no requests"):
        predict(profile, Layout("colocated", 1), [], 1, 1)


def test_compare_reports_errors_and_targets():
    measured = {"ttft_p50_s": 1.0, "itl_p50_s": 0.1, "attainment": 0.8}
    predicted = {"ttft_s": {"p50": 1.25}, "itl_s": {"p50": 0.09}, "slo_attainment": 0.95}
    row = compare(measured, predicted)
    assert row["ttft_p50_rel"] == pytest.approx(0.25) and row["itl_p50_rel"] == pytest.approx(-0.1)
    assert row["attainment_points"] == pytest.approx(0.15)
    assert row["within"] == {"ttft_p50_rel": False, "itl_p50_rel": True, "attainment_points": False}
    assert set(row["within"]) == set(TARGETS)
    refused = compare({"ttft_p50_s": None, "itl_p50_s": None, "attainment": 0.0},
                      {"slo_attainment": 0.0, "error": "needs 44 KV pages"})
    assert refused["ttft_p50_rel"] is None and refused["within"]["attainment_points"]


def test_the_deployments_pool_is_split_over_a_wide_workers_devices():
    profile = toy_profile()
    assert for_deployment(profile, Layout("colocated", 2), 1 << 30).serving.kv_pool_bytes == 1 << 30
    assert for_deployment(profile, Layout("chunked", 1, devices_per_worker=2), 1 << 30).serving.kv_pool_bytes == 1 << 29
