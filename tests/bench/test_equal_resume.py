"""An equal-hardware report rebuilt from saved runs with another profile: nothing is served, the sweep's
rates are the ones the runs were served at, and the predictions are the new profile's."""

from __future__ import annotations

import json
import os
import shutil

from clients.bench.bench_layouts import parse_layouts
from clients.bench.equal import EqualRun, run_equal_hardware
from clients.bench.equal_report import bracket
from clients.bench.suite import SUITES
from planner.profile import dump_profile, load_profile
from tests.conftest import leak_check, leak_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs", "benchmarks", "equal-hardware")


def test_a_report_rebuilt_with_another_profile_compares_the_same_runs(tmp_path):
    shutil.copy(os.path.join(DOCS, "runs.json"), tmp_path / "runs.json")
    with open(tmp_path / "runs.json", encoding="utf-8") as f:
        saved = json.load(f)
    # the other profile: the run's own without its served part (the profile before planner/served.py)
    served = load_profile(os.path.join(DOCS, "profile.json"))
    assert served.served is not None
    other = tmp_path / "unserved.json"
    other.write_text(dump_profile(served.model_copy(update={"served": None})))
    suite = SUITES[saved["suite"]]
    layouts = parse_layouts(",".join(saved["results"]), len(saved["cpus"]))
    # on its own, the other profile would have bracketed other rates than the runs were served at
    fresh = bracket(suite, layouts, load_profile(str(other)), 2 << 30, 256, len(saved["cpus"]))[1]["rates"]
    assert fresh != saved["sweep_rates"]["rates"]
    before = leak_snapshot()
    doc = run_equal_hardware(EqualRun(suite, layouts, saved["cpus"], str(tmp_path), profile=str(other), resume=True),
                             tokenizer=None, log=lambda _m: None)
    assert leak_check(before) == []
    assert doc["sweep_rates"] == saved["sweep_rates"] and doc["profile_file"] == str(other)
    rates = [f"rate-{r:g}" for r in saved["sweep_rates"]["rates"]]
    assert list(doc["scenarios"]) == [sc.name for sc in suite.seeds] + rates
    assert len(doc["validation"]) == len(layouts) * (len(suite.seeds) + len(rates))
    # the runs are the saved ones: the same requests, measured as they were
    for x in layouts:
        for name, records in saved["results"][x.name]["runs"].items():
            assert doc["records"][x.name][name] == records
    report = (tmp_path / "report.md").read_text()
    assert f"predicted on `{saved['sweep_rates']['profile_file']}` before the runs" in report
    # the predictions are the other profile's: without the served overhead every co-located step is
    # shorter than in the report the run wrote with its own profile
    with open(os.path.join(DOCS, "report.json"), encoding="utf-8") as f:
        written = json.load(f)
    for name in rates:
        for x in layouts:
            if x.kind != "disaggregated":
                assert (doc["scenarios"][name]["predicted"][x.name]["itl_s"]["p50"]
                        < written["scenarios"][name]["predicted"][x.name]["itl_s"]["p50"]), (name, x.name)
