"""Report math of the equal-hardware suite: SLO attainment, the rate a layout sustains, refusals,
and the seed workload's comparison against the claim (TTFT -25%, total time -22%).

- Attainment: the fraction of a run's measured requests whose TTFT <= the TTFT SLO and TPOT <= the
  TPOT SLO; failed and refused requests count as misses (DistServe's definition, as the planner's).
- Sustained rate: where the attainment-vs-rate curve first falls below the target, interpolated
  linearly between the two rates around the crossing (planner.plan.sustained_rate).
- Claim: for the seed burst, TTFT (p50 and mean) and total time (the burst's makespan: first send
  to last token) of a layout relative to a baseline; a reduction is 1 - layout / baseline.
"""

from __future__ import annotations

from clients.bench.stats import RequestRecord
from planner.plan import sustained_rate

CLAIM = {"ttft_reduction": 0.25, "total_reduction": 0.22}
REFUSED_MARKERS = ("RESOURCE_EXHAUSTED", "HTTP 429")  # the gRPC code and HTTP status of admission refusals


def attainment(summary: dict) -> float:
    """SLO attainment from a stats.summarize summary (0 when nothing completed)."""
    if not summary.get("requests"):
        raise ValueError("attainment of a run without measured requests is undefined")
    return summary.get("met_slo", 0) / summary["requests"]


def refused(records: list[RequestRecord]) -> int:
    """Measured requests the deployment refused at admission (they also count as SLO misses)."""
    return sum(1 for r in records if not r.warmup and r.error and any(m in r.error for m in REFUSED_MARKERS))


def sustained(curve: dict[float, float], target: float) -> dict:
    """{rate: attainment} -> {"rate", "beyond_range"}: the rate sustained at `target` attainment."""
    if not curve:
        raise ValueError("a sustained rate needs at least one measured rate")
    rate, beyond = sustained_rate(list(curve), list(curve.values()), target)
    return {"rate": rate, "beyond_range": beyond}


def claim_change(layout: dict, baseline: dict) -> dict:
    """Reductions of `layout` against `baseline` (stats summaries of the same seed burst)."""
    for s in (layout, baseline):
        if "error" in s:
            raise ValueError(f"cannot compare a run that failed: {s['error']}")
    return {"ttft_p50_reduction": 1 - layout["ttft_s"]["p50"] / baseline["ttft_s"]["p50"],
            "ttft_mean_reduction": 1 - layout["ttft_s"]["mean"] / baseline["ttft_s"]["mean"],
            "total_reduction": 1 - layout["window_s"] / baseline["window_s"]}


def verdict(change: dict) -> str:
    """Whether a change reaches the claim, in words."""
    t, total = change["ttft_mean_reduction"], change["total_reduction"]
    eps = 1e-9  # exactly the claim's figure reaches it, whatever the float rounding of the ratio
    meets = t >= CLAIM["ttft_reduction"] - eps and total >= CLAIM["total_reduction"] - eps
    return (f"TTFT mean {_pct(t)}, total time {_pct(total)}: "
            + ("reaches" if meets else "does not reach") + " the claim (TTFT -25%, total -22%)")


def _pct(reduction: float) -> str:
    return f"{-reduction:+.0%}"
