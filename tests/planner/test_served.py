"""A profile's `served` part: its fit, its lookup, its document, and what the simulator charges for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from planner.costs import PassCosts
from planner.plan_workload import RequestSpec
from planner.profile import ProfileError, dump_profile, load_profile, parse_profile
from planner.served import NONE, Served, ServedFit, ServedPoint, StepOverhead, fit_overhead, overhead
from planner.sim.sim_layouts import Layout
from planner.sim.sim_run import simulate
from tests.conftest import leak_check, leak_snapshot
from tests.planner.toy import toy_profile


def _point(batch: int, extra_s: float, predicted_s: float = 0.05) -> ServedPoint:
    return ServedPoint(role="colocated", batch=batch, context_tokens=64 * batch, seconds=predicted_s + extra_s,
                       predicted_s=predicted_s)


def test_the_fit_recovers_the_overhead_that_made_the_points():
    points = [_point(b, 0.003 + 0.001 * b, predicted_s=0.02 + 0.004 * b) for b in (1, 4, 16)]
    o = fit_overhead(points)
    assert o.per_step_s == pytest.approx(0.003) and o.per_sequence_s == pytest.approx(0.001)


def test_the_fit_never_makes_a_step_faster():
    # the extra falls with the batch: a negative slope is not allowed, so the best constant is taken
    o = fit_overhead([_point(1, 0.010), _point(4, 0.006), _point(16, 0.002)])
    assert o.per_sequence_s == 0 and o.per_step_s == pytest.approx(0.006)
    # served faster than predicted everywhere: nothing is charged
    assert fit_overhead([_point(1, -0.002), _point(8, -0.004)]) == NONE
    # one batch size only: the constant
    assert fit_overhead([_point(4, 0.004), _point(4, 0.006)]) == StepOverhead(pytest.approx(0.005), 0.0)
    with pytest.raises(ValueError, match="no served points"):
        fit_overhead([])


def test_a_shape_not_measured_takes_the_roles_nearest_device_count():
    served = Served(fits=(ServedFit(role="colocated", devices=1, per_step_s=0.001, per_sequence_s=0.0),
                          ServedFit(role="colocated", devices=4, per_step_s=0.004, per_sequence_s=0.0),
                          ServedFit(role="decode", devices=1, per_step_s=0.0, per_sequence_s=0.002)))
    assert overhead(served, "colocated", 4) == StepOverhead(0.004, 0.0)
    assert overhead(served, "colocated", 2) == StepOverhead(0.001, 0.0)  # 1 is nearer than 4
    assert overhead(served, "colocated", 8) == StepOverhead(0.004, 0.0)
    assert overhead(served, "decode", 2) == StepOverhead(0.0, 0.002)
    only_colocated = Served(fits=served.fits[:1])
    assert overhead(only_colocated, "decode", 1) == NONE and overhead(None, "colocated", 1) == NONE
    with pytest.raises(ValueError, match="allowed: decode, colocated"):
        overhead(served, "prefill", 1)


def test_the_served_part_round_trips_and_bad_ones_are_refused():
    fit = {"role": "decode", "devices": 1, "per_step_s": 0.002, "per_sequence_s": 0.001}
    p = toy_profile(served={"fits": [fit], "points": [
        {"role": "decode", "batch": 4, "context_tokens": 256, "seconds": 0.03, "predicted_s": 0.024}], "how": "t"})
    assert parse_profile(json.loads(dump_profile(p))) == p
    with pytest.raises(ProfileError, match="given more than once"):
        toy_profile(served={"fits": [fit, fit]})
    with pytest.raises(ProfileError, match=r"served\.fits\.0\.role"):
        toy_profile(served={"fits": [{**fit, "role": "prefill"}]})
    with pytest.raises(ProfileError, match=r"served\.fits\.0\.per_step_s"):
        toy_profile(served={"fits": [{**fit, "per_step_s": -1}]})


def test_pass_costs_charge_the_overhead_once_per_pass_for_every_sequence_in_it():
    o = StepOverhead(0.01, 0.002)
    plain = PassCosts.of(toy_profile(), prefill_speedup=2.0, decode_speedup=2.0)
    served = PassCosts.of(toy_profile(), prefill_speedup=2.0, decode_speedup=2.0, served=o)
    chunks = [(0, 32), (0, 16)]
    assert served.decode_time(8, 512) - plain.decode_time(8, 512) == pytest.approx(o(8))
    assert served.prefill_time(chunks) - plain.prefill_time(chunks) == pytest.approx(o(2))
    assert served.mixed_time(chunks, 8, 512) - plain.mixed_time(chunks, 8, 512) == pytest.approx(o(10))


SERVED = {"fits": [{"role": "colocated", "devices": 1, "per_step_s": 0.01, "per_sequence_s": 0.005},
                   {"role": "decode", "devices": 1, "per_step_s": 0.03, "per_sequence_s": 0.0}]}


@pytest.mark.parametrize("layout, charged", [
    (Layout("colocated", 1), 0.015),  # every pass of the co-located worker, its prefill pass included
    (Layout("chunked", 1), 0.015),
    (Layout("disaggregated", 1, 1), 0.03),  # the decode worker's steps; the prefill pass is not charged
])
def test_each_token_of_a_served_worker_comes_later_by_its_steps_overhead(layout, charged):
    spec = [RequestSpec(prompt_len=16, output_len=5, arrival=0.0)]
    plain = simulate(toy_profile(), layout, spec).requests[0].token_times()
    served = simulate(toy_profile(served=SERVED), layout, spec).requests[0].token_times()
    # token i waits for i + 1 charged passes (co-located: the prefill pass, then i decode steps), or i steps
    steps = np.arange(1, 6) if layout.kind != "disaggregated" else np.arange(0, 5)
    assert served - plain == pytest.approx(steps * charged)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_PROFILE = os.path.join(ROOT, "docs", "planning", "profiles", "cpu-2core-avx2.json")


@pytest.mark.slow
def test_tandem_profile_served_onto_a_profile_serves_and_fits_each_shape(built_engines, tmp_path):
    """On one core there is one shape, `colocated 1x1`: served for real, three bursts, one fit."""
    core = min(os.sched_getaffinity(0))
    out = tmp_path / "served.json"
    before = leak_snapshot()
    r = subprocess.run([sys.executable, "-m", "cli.main", "profile", "--served-onto", CPU_PROFILE, "--model",
                        str(built_engines), "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert leak_check(before) == []
    source, p = load_profile(CPU_PROFILE), load_profile(str(out))
    assert p.model_copy(update={"served": None}) == source  # the engine's part is the given profile's
    assert [(f.role, f.devices) for f in p.served.fits] == [("colocated", 1)]
    assert [pt.batch for pt in p.served.points] == [1, 4, 16]
    costs = PassCosts.of(source)
    for pt in p.served.points:
        assert pt.predicted_s == pytest.approx(costs.decode_time(pt.batch, pt.context_tokens)
                                               + source.frontdoor.per_token_s)
        assert 0.3 < pt.seconds / pt.predicted_s < 10, pt  # a gap between tokens of a real step, not of a burst
    fit = fit_overhead(p.served.points)
    assert (p.served.fits[0].per_step_s, p.served.fits[0].per_sequence_s) == (fit.per_step_s, fit.per_sequence_s)
    print("served on one core:", [(pt.batch, round(pt.seconds * 1e3, 1), round(pt.predicted_s * 1e3, 1))
                                  for pt in p.served.points])


def test_served_needs_one_core_per_device(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cli.main", "profile", "--served-onto", CPU_PROFILE, "--threads", "2",
                        "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1 and "--served serves one core per device; got --threads 2" in r.stderr
    assert not (tmp_path / "x.json").exists()
