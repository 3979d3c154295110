"""The equal-hardware report from hand-made runs: claim, attainment curves, predictions, files."""

from __future__ import annotations

import dataclasses
import json

import pytest

from clients.bench.equal_markdown import write_report
from clients.bench.equal_report import bracket, build
from clients.bench.slo import claim_change
from clients.bench.stats import RequestRecord
from clients.bench.suite import Suite, Sweep
from clients.bench.bench_workload import seed_scenario
from planner.plan import PlanRequest, capacity
from planner.plan_workload import Fixed, Poisson, Workload
from planner.sim.sim_layouts import Layout
from tests.planner.toy import toy_profile

SUITE = Suite("tiny", (seed_scenario(2 / 64, 1 / 16),), Sweep(32, 8, (1.0, 2.0), duration_s=2.0, min_requests=2),
              slo_ttft_s=1.0, slo_tpot_s=0.2)
LAYOUTS = [Layout("disaggregated", 1, 1), Layout("colocated", 2)]


def _rec(stream, start, ttft, gap, n, prompt):
    return RequestRecord(stream, start, [ttft + i * gap for i in range(n)], output_tokens=n, prompt_tokens=prompt)


def _runs(ttft: float, gap: float) -> dict:
    """Each scenario's requests sent at its own times, with the given first-token time and token gap."""
    runs = {}
    for sc in SUITE.scenarios():
        st = sc.streams[0]
        runs[sc.name] = [_rec(st.name, 0.5 * i, ttft * (1 + i), gap, st.output_len, st.prompt_len)
                         for i in range(st.count)]
    return runs


def test_report_from_hand_made_runs(tmp_path):
    results = {"1P1D": {"pinning": {"prefill-0": [0], "decode-0": [1]}, "runs": _runs(0.6, 0.1)},
               "colocated 2x1": {"pinning": {"generate-0": [0], "generate-1": [1]}, "runs": _runs(0.8, 0.15)}}
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.01}, decode={"intercept_s": 0.1})
    context = {"command": "tandem bench compare --suite tiny", "cpus": [0, 1], "protocol": "grpc",
               "machine": {"load_before": "0.1", "load_after": "0.2", "note": "test"}, "kv_pool_bytes": 1 << 30,
               "chunk_tokens": 256, "kv_need_bytes": 1000, "limits": {"max_in_flight": 10}}
    doc = build(SUITE, LAYOUTS, results, profile, 1 << 30, 256, context)
    seed = SUITE.seeds[0].name
    s = doc["scenarios"][seed]["summary"]
    (claim,) = doc["seeds"][seed]
    assert (claim["disaggregated"], claim["baseline"]) == ("1P1D", "colocated 2x1")
    assert claim["measured"] == claim_change(s["1P1D"], s["colocated 2x1"])
    assert claim["measured"]["ttft_mean_reduction"] == pytest.approx(0.25)  # 0.6 x 1.5 vs 0.8 x 1.5
    # 2 requests at 1 req/s (TTFTs 0.6, 1.2: one meets 1 s), 4 at 2 req/s (0.6 .. 2.4: one meets it)
    assert doc["sweep"]["measured"]["1P1D"] == {1.0: 0.5, 2.0: 0.25}
    assert doc["sweep"]["sustained"]["1P1D"]["measured"]["rate"] == 0.0
    assert len(doc["validation"]) == 2 * 3 and doc["validation_summary"]["rows"] == 6
    row = next(r for r in doc["validation"] if r["layout"] == "1P1D" and r["scenario"] == "rate-2")
    assert row["rate"] == 2.0 and row["measured"]["ttft_p50_s"] == pytest.approx(1.5)
    assert {r["layout"] for r in doc["plan"]["results"]} >= {"1P1D", "colocated 2x1"}
    paths = write_report(doc, results, str(tmp_path))
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["records"]["1P1D"][seed][0]["response_times"][0] == pytest.approx(0.6)
    md = (tmp_path / "report.md").read_text()
    assert "| 1P1D | colocated 2x1 | -25% | -25% |" in md
    assert "| 1P1D | prefill-0: [0], decode-0: [1] |" not in md and "| 1P1D | 2 | prefill-0: [0], decode-0: [1] |" in md
    assert all(open(p, "rb").read(4) == b"\x89PNG" for p in paths if p.endswith(".png"))


def test_a_sweep_around_the_predicted_capacity_gets_its_rates_before_anything_runs():
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.01}, decode={"intercept_s": 0.1})
    fixed, how = bracket(SUITE, LAYOUTS, profile, 1 << 30, 256, 2)
    assert fixed is SUITE and how == {}
    around = dataclasses.replace(SUITE, sweep=Sweep(32, 8, (), duration_s=2.0, min_requests=2, around=(0.5, 1.0, 2.0)))
    suite, how = bracket(around, LAYOUTS, profile, 1 << 30, 256, 2)
    plan = capacity(profile, PlanRequest(devices=2, workload=Workload(prompt=Fixed(value=32), output=Fixed(value=8),
                                                                      arrivals=Poisson(rate=1.0), requests=400),
                                         slo_ttft_s=1.0, slo_tpot_s=0.2, target=0.9))
    predicted = {x.name: plan["sustained"][x.name]["rate"] for x in LAYOUTS}
    center = sum(predicted.values()) / 2
    assert how["predicted_capacity"] == predicted and how["center"] == pytest.approx(center) and center > 0
    assert suite.sweep.rates == tuple(how["rates"]) and len(suite.sweep.rates) == 3
    for f, r in zip((0.5, 1.0, 2.0), suite.sweep.rates):
        assert r == pytest.approx(f * center, abs=0.025)  # rounded to 0.05 req/s
    assert [sc.name for sc in suite.scenarios()][1:] == [f"rate-{r:g}" for r in suite.sweep.rates]
