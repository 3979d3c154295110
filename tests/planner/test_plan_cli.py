"""`tandem plan` end to end on a small hand-made profile: files, recommendation, errors."""

from __future__ import annotations

import json

from click.testing import CliRunner

from cli.main import main

# Long prompts (2 s passes) and a tight TPOT: a co-located engine stalls its streams for every new
# prompt (prefill-first) or slows every step (chunked); disaggregation keeps decode steps at ~20 ms.
STALL = {
    "format": "tandem-profile/1", "name": "stall toy", "hardware": {"device": "toy accelerator"},
    "model": {"name": "toy", "params": 1000000, "kv_bytes_per_token": 100000},
    "serving": {"pass_tokens": 4096, "chunk_tokens": 256, "kv_pool_bytes": 10 ** 11},
    "prefill": {"fit": {"intercept_s": 0.01, "per_token_s": 0.001}},
    "decode": {"fit": {"intercept_s": 0.02, "per_sequence_s": 0.0001}},
    "handoff": {"gbytes_per_s": 10, "latency_s": 0.001},
    "frontdoor": {"ttft_s": 0.0015, "per_token_s": 0.0001},
    "sources": [{"what": "everything", "citation": "made up for this test"}],
}
WORKLOAD = ["--prompt-len", "2000", "--output-len", "50", "--slo-ttft-ms", "10000", "--slo-tpot-ms", "40",
            "--requests", "200"]


def _profile(tmp_path, doc=STALL) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_capacity_plan_recommends_disaggregation_when_prefill_stalls_decode(tmp_path):
    out = tmp_path / "plan"
    r = CliRunner().invoke(main, ["plan", "--profile", _profile(tmp_path), "--devices", "2", *WORKLOAD,
                                  "--rates", "0.1,0.2,0.3,0.4,0.6", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "plan.json").read_text())
    assert doc["format"] == "tandem-plan/1" and doc["mode"] == "capacity"
    rec = doc["recommendation"]
    assert rec["layout"] == "1P1D" and not rec["beyond_range"]
    s = doc["sustained"]
    assert s["1P1D"]["rate"] > 1.2 * max(s["colocated 2x1"]["rate"], s["chunked 2x1"]["rate"])
    assert 0.4 <= s["1P1D"]["rate"] <= 0.6
    assert len(doc["results"]) == 3 * 5
    assert set(doc["skipped_layouts"]) == {"colocated 1x2", "chunked 1x2"}  # the profile gives no scaling
    md = (out / "plan.md").read_text()
    assert "**Recommendation: 1P1D**" in md and "| colocated 2x1 |" in md
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert "recommendation: 1P1D" in r.output


def test_sizing_plan_finds_the_fewest_devices(tmp_path):
    # 4 closed-loop clients of 2000-token prompts: on one device new prompts stall the streams (TPOT);
    # on two, several layouts meet the SLO and the one with the most goodput is chosen.
    out = tmp_path / "size"
    r = CliRunner().invoke(main, ["plan", "--profile", _profile(tmp_path), "--devices", "3", *WORKLOAD,
                                  "--concurrency", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "plan.json").read_text())
    assert doc["mode"] == "sizing"
    one_device = [x for x in doc["results"] if x["devices"] == 1]
    assert {x["layout"] for x in one_device} == {"colocated 1x1", "chunked 1x1"}
    assert all(x["metrics"]["slo_attainment"] < 0.9 for x in one_device)
    two = [x for x in doc["results"] if x["devices"] == 2 and x["metrics"]["slo_attainment"] >= 0.9]
    assert len(two) >= 2
    best = max(two, key=lambda x: (x["metrics"]["slo_attainment"], x["metrics"]["goodput_rps"]))
    assert doc["recommendation"]["devices"] == 2 and doc["recommendation"]["layout"] == best["layout"]
    assert f"Recommendation: {best['layout']} on 2 device(s)" in (out / "plan.md").read_text()


def test_plan_errors_are_clear(tmp_path):
    run = CliRunner().invoke
    r = run(main, ["plan", "--profile", _profile(tmp_path), "--devices", "2", *WORKLOAD, "--rate", "1",
                   "--rates", "1,2", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "give at most one of --rate, --concurrency, --rates" in r.output
    r = run(main, ["plan", "--profile", _profile(tmp_path), "--devices", "2", "--prompt-len", "uniform:5",
                   "--slo-ttft-ms", "1", "--slo-tpot-ms", "1", "--out", str(tmp_path / "x")])
    assert r.exit_code == 1 and "bad length 'uniform:5'" in r.output
    r = run(main, ["plan", "--profile", _profile(tmp_path, {**STALL, "decode": {}}), "--devices", "2", *WORKLOAD,
                   "--out", str(tmp_path / "x")])
    assert r.exit_code == 1 and "decode: Value error, give measured 'points', a 'fit', or both" in r.output
    r = run(main, ["plan", "--profile", _profile(tmp_path), "--devices", "2", *WORKLOAD, "--rates", "1,-2",
                   "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "every rate must be > 0" in r.output
    assert not (tmp_path / "x").exists()
