"""What a simulated run measured, as a client would see it (front-door overhead included).

The front door adds `frontdoor.ttft_s` to the first token and `frontdoor.per_token_s` to every gap
between tokens (as scripts/bench_frontdoor.py measures it: front-door TPOT minus direct TPOT), so
client token i arrives at engine time + ttft_s + i * per_token_s.
- TTFT: first token - arrival. TPOT: (last - first) / (tokens - 1), for answers of 2+ tokens (a
  one-token answer meets any TPOT SLO). ITL: every gap between consecutive tokens. E2E: last - arrival.
- Window: first arrival to last token. Throughput and goodput are per second of that window, so they
  include the drain after the last arrival (small when arrivals span many request lifetimes; an
  open-loop capacity report uses rate x attainment as goodput instead).
- A request meets the SLO when TTFT <= slo_ttft and TPOT <= slo_tpot; attainment is the fraction of
  all requests (refused ones included) that do; goodput is those requests per second.
- Priority classes: with `slo_priority` P the SLO is for the requests of priority <= P only (the others
  are served best effort): attainment is the fraction of those that meet it, goodput counts only them.
  A run of several classes also reports each class alone (`by_priority`, every one against the limits).
"""

from __future__ import annotations

import numpy as np

from planner.profile import FrontDoor
from planner.sim.request import SimRequest

PERCENTILES = (50, 90, 99)


def _dist(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    out = {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}
    out["mean"] = float(values.mean())
    return out


def client_times(req: SimRequest, front: FrontDoor) -> np.ndarray:
    """When the client receives each token: [answer_len]."""
    t = req.token_times()
    return t + front.ttft_s + np.arange(t.size) * front.per_token_s


def summarize(requests: list[SimRequest], front: FrontDoor, slo_ttft_s: float, slo_tpot_s: float,
              slo_priority: int | None = None) -> dict:
    """Percentiles (seconds), throughput and SLO figures of one run; see the module docstring."""
    out = _summary(requests, front, slo_ttft_s, slo_tpot_s, slo_priority)
    classes = sorted({r.priority for r in requests})
    if len(classes) > 1:
        out["by_priority"] = {str(p): _summary([r for r in requests if r.priority == p], front, slo_ttft_s,
                                               slo_tpot_s, None) for p in classes}
    return out


def _summary(requests: list[SimRequest], front: FrontDoor, slo_ttft_s: float, slo_tpot_s: float,
             slo_priority: int | None) -> dict:
    counted = [slo_priority is None or r.priority <= slo_priority for r in requests]  # the SLO's requests
    done = [r for r in requests if r.failed is None]
    if not done:
        return {"requests": len(requests), "refused": len(requests), "slo_attainment": 0.0, "goodput_rps": 0.0,
                "error": requests[0].failed if requests else "no requests"}
    times = [client_times(r, front) for r in done]
    arrivals = np.array([r.arrival for r in done])
    ttft = np.array([t[0] for t in times]) - arrivals
    last = np.array([t[-1] for t in times])
    multi = np.array([t.size > 1 for t in times])
    tpot = np.array([(t[-1] - t[0]) / (t.size - 1) if t.size > 1 else 0.0 for t in times])
    gaps = np.concatenate([np.diff(t) for t in times]) if any(multi) else np.zeros(0)
    eps = 1e-12  # an answer exactly at the SLO meets it, whatever the float rounding of its sums
    in_slo = np.array([c for c, r in zip(counted, requests) if r.failed is None], dtype=bool)
    good = (ttft <= slo_ttft_s + eps) & (tpot <= slo_tpot_s + eps) & in_slo
    window = float(last.max() - min(r.arrival for r in requests))
    tokens = int(sum(r.answer_len for r in done))
    return {
        "requests": len(requests), "refused": len(requests) - len(done), "window_s": window,
        "ttft_s": _dist(ttft), "tpot_s": _dist(tpot[multi]), "itl_s": _dist(gaps), "e2e_s": _dist(last - arrivals),
        "queue_s": _dist(np.array([r.prefill_start - r.arrival for r in done])),
        "throughput_rps": len(done) / window if window > 0 else 0.0,
        "output_tokens_per_s": tokens / window if window > 0 else 0.0,
        "goodput_rps": int(good.sum()) / window if window > 0 else 0.0,
        "slo_attainment": int(good.sum()) / max(1, sum(counted)), "met_slo": int(good.sum()),
    }
