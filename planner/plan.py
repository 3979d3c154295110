"""`tandem plan`: simulate every layout on a workload and recommend the one that meets the SLO best.

Two questions, by how the load is given:
- capacity (a list of rates, or none: a range is chosen from the profile): on N devices, which
  layout sustains the highest Poisson rate with SLO attainment >= target? A layout's sustained rate
  is where its attainment curve first falls below the target, linearly interpolated between the
  two rates around the crossing (DistServe's "goodput rate" at 90% attainment).
- sizing (one `rate` or a closed-loop `concurrency`): what is the fewest devices, and on them the
  layout, that meets the target at that load? Every device count 1..N is simulated.
Every layout of a question is simulated on the same drawn requests (same seed). With priority classes
and `slo_priority` P, "meets the SLO" counts the requests of priority <= P only; the others are served
best effort (planner/sim/sim_metrics.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.costs import PassCosts
from planner.profile import Profile
from planner.sim.sim_layouts import Layout, layouts_for
from planner.sim.sim_metrics import summarize
from planner.sim.sim_run import simulate
from planner.plan_workload import ClosedLoop, Poisson, Workload, draw

PLAN_FORMAT = "tandem-plan/1"


@dataclass(frozen=True)
class PlanRequest:
    devices: int
    workload: Workload  # its arrivals: the sizing load (Poisson or closed loop); ignored when `rates`
    slo_ttft_s: float
    slo_tpot_s: float
    target: float = 0.9
    rates: tuple[float, ...] | None = None  # capacity sweep; None with sizing=False: chosen automatically
    sizing: bool = False
    chunk_tokens: int | None = None
    min_duration_s: float = 30.0  # open loop: at least rate * this many requests per simulation
    slo_priority: int | None = None  # the SLO holds for requests of this priority or a lower value; None: all

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if not 0 < self.target <= 1:
            raise ValueError(f"the attainment target must be in (0, 1], got {self.target}")
        if self.slo_ttft_s <= 0 or self.slo_tpot_s <= 0:
            raise ValueError("SLO limits must be > 0")
        if self.min_duration_s < 0:
            raise ValueError(f"min_duration_s must be >= 0, got {self.min_duration_s}")
        if self.rates is not None and (not self.rates or any(r <= 0 for r in self.rates)):
            raise ValueError(f"rates must be > 0 requests/s, got {list(self.rates)}")
        classes = sorted(s.priority for s in self.workload.priorities) or [0]
        if self.slo_priority is not None and self.slo_priority < classes[0]:
            raise ValueError(f"the SLO's priority {self.slo_priority} covers no class of the workload (priorities "
                             f"{', '.join(map(str, classes))}; the SLO holds for those <= it)")


def run_one(profile: Profile, layout: Layout, workload: Workload, req: PlanRequest) -> dict:
    """Simulate one (layout, load) point; its summary (see sim/metrics.py).

    An open-loop point simulates at least `min_duration_s` seconds of arrivals: a few hundred requests
    at hundreds per second would all arrive within one request's lifetime, and a system that never
    reached its steady load would look better than it is.
    """
    arrivals = workload.arrivals
    concurrency = arrivals.concurrency if isinstance(arrivals, ClosedLoop) else None
    if concurrency is None:
        need = math.ceil(arrivals.rate * req.min_duration_s)
        workload = workload.model_copy(update={"requests": max(workload.requests, need)})
    run = simulate(profile, layout, draw(workload), concurrency=concurrency, chunk_tokens=req.chunk_tokens)
    return summarize(run.requests, profile.frontdoor, req.slo_ttft_s, req.slo_tpot_s, req.slo_priority)


def default_rates(profile: Profile, workload: Workload, devices: int, points: int = 10) -> tuple[float, ...]:
    """`points` rates up to ~1.5x a rough capacity: devices / (prefill time + decode device-time) per request."""
    specs = draw(workload.with_arrivals(ClosedLoop(concurrency=1)))
    prompt = sum(s.prompt_len for s in specs) / len(specs)
    output = sum(s.output_len for s in specs) / len(specs)
    costs = PassCosts.of(profile)
    s = profile.serving
    pool_tokens = s.kv_pool_bytes // profile.model.kv_bytes_per_token
    batch = max(1, min(s.decode_max_batch, int(pool_tokens // (prompt + output))))
    step = costs.decode_time(batch, int(batch * (prompt + output / 2)))
    per_request = costs.prefill_time([(0, max(1, round(prompt)))]) + max(0.0, output - 1) * step / batch
    top = 1.5 * devices / per_request
    return tuple(float(f"{top * (i + 1) / points:.3g}") for i in range(points))


def sustained_rate(rates: list[float], attainment: list[float], target: float) -> tuple[float, bool]:
    """(rate, beyond_range): where attainment first drops below target (interpolated); beyond_range
    when it never does within the rates tested (the rate is then the highest one tested)."""
    pairs = sorted(zip(rates, attainment))
    if pairs[0][1] < target:
        return 0.0, False
    for (r0, a0), (r1, a1) in zip(pairs, pairs[1:]):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1), False
    return pairs[-1][0], True


def capacity(profile: Profile, req: PlanRequest, log=lambda _m: None) -> dict:
    """The capacity question on req.devices devices (see the module docstring).

    With rates chosen automatically, the sweep is extended (up to 3 times, to twice its top each time)
    while some layout still meets the target at the highest rate, so every layout's crossing is found.
    """
    rates = list(req.rates or default_rates(profile, req.workload, req.devices))
    layouts, skipped = layouts_for(profile, req.devices)
    results: list[dict] = []
    _sweep(profile, req, layouts, rates, results)
    for _ in range(0 if req.rates else 3):
        if not any(_sustained(results, n, req.target)[1] for n in (x.name for x in layouts)):
            break
        top = rates[-1]
        more = [float(f"{top * (1 + (i + 1) / 5):.3g}") for i in range(5)]
        log(f"some layouts meet the target at {top:g} req/s; extending the sweep to {more[-1]:g} req/s")
        _sweep(profile, req, layouts, more, results)
        rates += more
    sustained = {}
    for layout in layouts:
        r, beyond = _sustained(results, layout.name, req.target)
        sustained[layout.name] = {"rate": r, "per_device": r / layout.devices, "beyond_range": beyond}
        log(f"{layout.name}: sustains {r:.3g} req/s at {req.target:.0%} attainment" + (" (or more)" if beyond else ""))
    best = max(sustained, key=lambda n: (sustained[n]["rate"], -_kind_rank(n)))
    return _document(profile, req, "capacity", results, skipped, {
        "rates": rates, "sustained": sustained, "recommendation": _capacity_choice(best, sustained, req)})


def _sweep(profile: Profile, req: PlanRequest, layouts: list[Layout], rates: list[float], results: list) -> None:
    for layout in layouts:
        for rate in rates:
            m = run_one(profile, layout, req.workload.with_arrivals(Poisson(rate=rate)), req)
            results.append({"layout": layout.name, "kind": layout.kind, "devices": layout.devices, "rate": rate,
                            "metrics": m})


def _sustained(results: list[dict], name: str, target: float) -> tuple[float, bool]:
    rows = [r for r in results if r["layout"] == name]
    return sustained_rate([r["rate"] for r in rows], [r["metrics"]["slo_attainment"] for r in rows], target)


def _kind_rank(name: str) -> int:
    """On a tie, prefer the simpler system: one co-located engine, then replicas, then disaggregation."""
    return 0 if name.startswith("colocated") else 1 if name.startswith("chunked") else 2


def _capacity_choice(best: str, sustained: dict, req: PlanRequest) -> dict:
    s = sustained[best]
    if s["rate"] == 0:
        return {"layout": None, "reason": f"no layout reaches {req.target:.0%} SLO attainment even at the lowest "
                                          f"rate tested; relax the SLO, add devices or test lower rates"}
    colo = [n for n in sustained if not n[0].isdigit()]
    disagg = [n for n in sustained if n[0].isdigit()]
    out = {"layout": best, "rate": s["rate"], "per_device": s["per_device"], "beyond_range": s["beyond_range"]}
    if colo and disagg:
        bc = max(colo, key=lambda n: sustained[n]["rate"])
        bd = max(disagg, key=lambda n: sustained[n]["rate"])
        out["best_disaggregated"], out["best_colocated"] = bd, bc
        if sustained[bc]["rate"] > 0:
            out["disaggregated_vs_colocated"] = sustained[bd]["rate"] / sustained[bc]["rate"]
    out["reason"] = (f"{best} sustains the highest rate with >= {req.target:.0%} of requests meeting the SLO"
                     + ("; it met the target at every rate tested, so test higher rates" if s["beyond_range"] else ""))
    return out


def sizing(profile: Profile, req: PlanRequest, log=lambda _m: None) -> dict:
    """The sizing question: fewest devices (1..req.devices) and layout meeting the target at one load."""
    results, skipped_all, choice = [], {}, None
    for n in range(1, req.devices + 1):
        layouts, skipped = layouts_for(profile, n)
        skipped_all.update(skipped)
        for layout in layouts:
            m = run_one(profile, layout, req.workload, req)
            results.append({"layout": layout.name, "kind": layout.kind, "devices": n, "metrics": m})
        meeting = [r for r in results if r["devices"] == n and r["metrics"]["slo_attainment"] >= req.target]
        log(f"{n} device(s): {len(meeting)} of {len(layouts)} layouts meet the target")
        if meeting and choice is None:
            top = max(meeting, key=lambda r: (r["metrics"]["slo_attainment"], r["metrics"]["goodput_rps"],
                                              -_kind_rank(r["layout"])))
            choice = {"layout": top["layout"], "devices": n, "slo_attainment": top["metrics"]["slo_attainment"],
                      "reason": f"the fewest devices on which a layout meets {req.target:.0%} SLO attainment; "
                                f"among those layouts, the highest attainment (then goodput)"}
    if choice is None:
        choice = {"layout": None, "reason": f"no layout on up to {req.devices} devices reaches {req.target:.0%} SLO "
                                            f"attainment at this load; add devices, lower the load or relax the SLO"}
    return _document(profile, req, "sizing", results, skipped_all, {"recommendation": choice})


def plan(profile: Profile, req: PlanRequest, log=lambda _m: None) -> dict:
    """Answer the request's question; the JSON document `tandem plan` writes."""
    return sizing(profile, req, log) if req.sizing else capacity(profile, req, log)


def _max_error(phase) -> float | None:
    return phase.fit_error.max_rel if phase.fit_error is not None else None


def _document(profile: Profile, req: PlanRequest, mode: str, results: list, skipped: dict, extra: dict) -> dict:
    workload = req.workload.model_dump(exclude_none=True)  # a class without lengths of its own: no keys
    if mode == "capacity":
        workload["arrivals"] = {"kind": "poisson", "rates": extra["rates"]}
    return {
        "format": PLAN_FORMAT, "mode": mode,
        "profile": {"name": profile.name, "hardware": profile.hardware, "model": profile.model.name,
                    "fit_error_max": {"prefill": _max_error(profile.prefill), "decode": _max_error(profile.decode)},
                    "handoff_gbytes_per_s": profile.handoff.gbytes_per_s,
                    "frontdoor": profile.frontdoor.model_dump(exclude={"how"}),
                    "served": [f.model_dump() for f in profile.served.fits] if profile.served else []},
        "devices": req.devices, "workload": workload,
        "slo": {"ttft_s": req.slo_ttft_s, "tpot_s": req.slo_tpot_s, "target_attainment": req.target,
                "priority": req.slo_priority},
        "chunk_tokens": req.chunk_tokens or profile.serving.chunk_tokens, "min_duration_s": req.min_duration_s,
        "skipped_layouts": skipped, "results": results, **extra,
    }
