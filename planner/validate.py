"""Validating the planner against measured runs: simulate exactly the requests a benchmark sent
(their send times and lengths) on the same layout, and compare what the client saw.

Replaying the measured arrivals, not fresh Poisson draws, takes sampling noise out of the
comparison: a miss is the model's (pass times, scheduling rules) or the machine's (interference the
profile did not see), not the luck of one run's arrival times.

Targets (issue #13): p50 TTFT and p50 ITL within +-20% of the measured value, SLO attainment within
10 points.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.profile import Profile
from planner.sim.sim_layouts import Layout
from planner.sim.sim_metrics import summarize
from planner.sim.sim_run import simulate
from planner.plan_workload import RequestSpec

TARGETS = {"ttft_p50_rel": 0.20, "itl_p50_rel": 0.20, "attainment_points": 0.10}


@dataclass(frozen=True)
class Sent:
    """One request as a benchmark sent it: seconds after the run started, and its lengths."""

    at: float
    prompt_len: int
    output_len: int


def for_deployment(profile: Profile, layout: Layout, pool_bytes_per_worker: int) -> Profile:
    """The profile with the KV pool of the deployment that was measured (the profile gives bytes per
    device; a 1xN worker's single pool is split over its N devices)."""
    per_device = max(1, pool_bytes_per_worker // layout.devices_per_worker)
    return profile.model_copy(update={"serving": profile.serving.model_copy(update={"kv_pool_bytes": per_device})})


def predict(profile: Profile, layout: Layout, sent: list[Sent], slo_ttft_s: float, slo_tpot_s: float,
            chunk_tokens: int | None = None) -> dict:
    """The simulator's summary (planner.sim.sim_metrics) of these requests on `layout`."""
    if not sent:
        raise ValueError("nothing to predict: no requests were sent")
    t0 = min(s.at for s in sent)
    specs = [RequestSpec(s.prompt_len, s.output_len, s.at - t0) for s in sorted(sent, key=lambda s: s.at)]
    run = simulate(profile, layout, specs, chunk_tokens=chunk_tokens)
    return summarize(run.requests, profile.frontdoor, slo_ttft_s, slo_tpot_s)


def compare(measured: dict, predicted: dict) -> dict:
    """Side by side: measured and predicted p50 TTFT, p50 ITL and attainment, the errors, and whether
    each is within TARGETS. `measured` holds ttft_p50_s, itl_p50_s and attainment."""
    pred = {"ttft_p50_s": _p50(predicted, "ttft_s"), "itl_p50_s": _p50(predicted, "itl_s"),
            "attainment": predicted["slo_attainment"]}
    row = {"measured": measured, "predicted": pred}
    for key, metric in (("ttft_p50_rel", "ttft_p50_s"), ("itl_p50_rel", "itl_p50_s")):
        m, p = measured.get(metric), pred[metric]
        row[key] = None if not m or p is None else p / m - 1
    row["attainment_points"] = pred["attainment"] - measured["attainment"]
    row["within"] = {k: row[k] is not None and abs(row[k]) <= limit for k, limit in TARGETS.items()}
    return row


def _p50(summary: dict, key: str) -> float | None:
    return summary[key]["p50"] if key in summary else None
