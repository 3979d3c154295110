"""The equal-hardware report's document: measured summaries, the claim comparison on the seed bursts,
SLO attainment vs rate, and the planner's predictions next to every measured run.

Every run records what other processes took from the machine meanwhile (interference.py); the
validation is summarised over all runs and over the quiet ones.

Predictions come two ways: the simulator replaying exactly the requests each run sent (validation:
planner/validate.py), and `tandem plan` itself at the sweep's rates (its own Poisson draws, at least
30 s of arrivals per point), as a user would run it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform

from clients.bench.bench_report import records_json
from clients.bench.slo import attainment, claim_change, refused, sustained
from clients.bench.stats import RequestRecord, summarize
from clients.bench.suite import Suite
from planner.plan import PlanRequest, capacity
from planner.profile import Profile
from planner.sim.sim_layouts import Layout
from planner.validate import Sent, compare, for_deployment, predict
from planner.plan_workload import Fixed, Poisson, Workload

# A run during which other processes used at most this many cores (machine-wide, on average) counts as
# quiet: on 2 cores that is a tenth of the machine, well under the +-20% the validation allows.
QUIET_CORES = 0.2


def sent_of(records: list[RequestRecord], scenario) -> list[Sent]:
    """What a run sent: send times and lengths (prompt lengths as the server counted them)."""
    lengths = {st.name: (st.prompt_len, st.output_len) for st in scenario.streams}
    return [Sent(r.start, r.prompt_tokens or lengths[r.stream][0], lengths[r.stream][1])
            for r in records if not r.warmup]


def measured_row(summary: dict) -> dict:
    return {"ttft_p50_s": summary["ttft_s"]["p50"] if "ttft_s" in summary else None,
            "itl_p50_s": summary["itl_s"]["p50"] if "itl_s" in summary else None, "attainment": attainment(summary)}


def build(suite: Suite, layouts: list[Layout], results: dict, profile: Profile, pool_bytes: int, chunk_tokens: int,
          context: dict) -> dict:
    """results: {layout name: run_layout's dict}; context: command, cpus, loads, settings (recorded as given)."""
    doc = {"format": "tandem-equal-hardware/1", "suite": suite.name,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "cpus_on_machine": os.cpu_count(), **context["machine"]},
           **{k: v for k, v in context.items() if k != "machine"},
           "slo": {"ttft_s": suite.slo_ttft_s, "tpot_s": suite.slo_tpot_s, "target": suite.target},
           "profile": {"name": profile.name, "measured": profile.measured.model_dump() if profile.measured else None,
                       "handoff_gbytes_per_s": profile.handoff.gbytes_per_s},
           "layouts": {x.name: {"pinning": results[x.name]["pinning"], "cores": x.devices} for x in layouts},
           "scenarios": {}, "validation": []}
    for sc in suite.scenarios():
        doc["scenarios"][sc.name] = _scenario(sc, suite, layouts, results, profile, pool_bytes, chunk_tokens, doc)
    doc["seeds"] = {sc.name: _claims(doc["scenarios"][sc.name], layouts) for sc in suite.seeds}
    doc["sweep"] = _sweep(suite, layouts, doc)
    doc["plan"] = _plan(suite, profile, pool_bytes, chunk_tokens, len(context["cpus"]))
    doc["validation_summary"] = _met(doc["validation"])
    quiet = [r for r in doc["validation"] if r["others_cores"] is not None and r["others_cores"] <= QUIET_CORES]
    doc["validation_summary"]["quiet"] = _met(quiet)
    doc["records"] = {x.name: {n: records_json(rs) for n, rs in results[x.name]["runs"].items()} for x in layouts}
    return doc


def _met(rows: list[dict]) -> dict:
    out = {k: sum(r["within"][k] for r in rows) for k in ("ttft_p50_rel", "itl_p50_rel", "attainment_points")}
    return {**out, "rows": len(rows)}


def _scenario(sc, suite, layouts, results, profile, pool_bytes, chunk_tokens, doc) -> dict:
    out = {"description": sc.description, "definition": sc.to_dict(), "summary": {}, "predicted": {}, "refused": {}}
    rate = sc.streams[0].rate or None
    for x in layouts:
        records = results[x.name]["runs"][sc.name]
        summary = summarize(records, suite.slo_ttft_s, suite.slo_tpot_s)
        pred = predict(for_deployment(profile, x, pool_bytes), x, sent_of(records, sc), suite.slo_ttft_s,
                       suite.slo_tpot_s, chunk_tokens)
        out["summary"][x.name], out["predicted"][x.name] = summary, pred
        out["refused"][x.name] = refused(records)
        cpu = results[x.name].get("cpu", {}).get(sc.name)
        doc["validation"].append({"layout": x.name, "scenario": sc.name, "rate": rate,
                                  "others_cores": cpu["others_cores"] if cpu else None,
                                  **compare(measured_row(summary), pred)})
    return out


def _claims(scenario: dict, layouts: list[Layout]) -> list[dict]:
    """Every disaggregated layout against every co-located one, measured and predicted."""
    out = []
    for d in (x.name for x in layouts if x.kind == "disaggregated"):
        for c in (x.name for x in layouts if x.kind != "disaggregated"):
            m, p = scenario["summary"], scenario["predicted"]
            row = {"disaggregated": d, "baseline": c}
            row["measured"] = claim_change(m[d], m[c]) if "error" not in m[d] and "error" not in m[c] else None
            # the simulator's summaries carry the same ttft_s / window_s keys
            row["predicted"] = claim_change(p[d], p[c]) if "error" not in p[d] and "error" not in p[c] else None
            out.append(row)
    return out


def _sweep(suite: Suite, layouts: list[Layout], doc: dict) -> dict:
    rates = list(suite.sweep.rates)
    out = {"rates": rates, "measured": {}, "predicted": {}, "sustained": {}}
    for x in layouts:
        names = [f"rate-{r:g}" for r in rates]
        m = {r: attainment(doc["scenarios"][n]["summary"][x.name]) for r, n in zip(rates, names)}
        p = {r: doc["scenarios"][n]["predicted"][x.name]["slo_attainment"] for r, n in zip(rates, names)}
        out["measured"][x.name], out["predicted"][x.name] = m, p
        out["sustained"][x.name] = {"measured": sustained(m, suite.target), "predicted": sustained(p, suite.target)}
    return out


def _plan(suite: Suite, profile: Profile, pool_bytes: int, chunk_tokens: int, devices: int) -> dict:
    """`tandem plan` at the sweep's rates (capacity question) on the suite's cores."""
    return capacity(_with_pool(profile, pool_bytes), _capacity_request(suite, chunk_tokens, devices, suite.sweep.rates))


def bracket(suite: Suite, layouts: list[Layout], profile: Profile, pool_bytes: int, chunk_tokens: int,
            devices: int) -> tuple[Suite, dict]:
    """(the suite with its sweep's rates, how they were chosen): a sweep given `around` gets those fractions
    of the capacity `tandem plan` predicts on `profile` (the mean of the layouts' sustained rates, its own
    rates chosen automatically), rounded to 0.05 req/s; a sweep with rates keeps them ({})."""
    s = suite.sweep
    if not s.around:
        return suite, {}
    doc = capacity(_with_pool(profile, pool_bytes), _capacity_request(suite, chunk_tokens, devices, None))
    predicted = {x.name: doc["sustained"][x.name]["rate"] for x in layouts if x.name in doc["sustained"]}
    if not predicted or not any(predicted.values()):
        raise ValueError(f"the planner predicts no capacity for {', '.join(x.name for x in layouts)} on this profile "
                         f"(SLO TTFT <= {suite.slo_ttft_s:g} s, TPOT <= {suite.slo_tpot_s:g} s): nothing to bracket")
    center = sum(predicted.values()) / len(predicted)
    rates = tuple(sorted({max(0.05, round(f * center / 0.05) * 0.05) for f in s.around}))
    rates = tuple(float(f"{r:.2f}") for r in rates)
    how = {"around": list(s.around), "predicted_capacity": predicted, "center": center, "rates": list(rates)}
    return dataclasses.replace(suite, sweep=dataclasses.replace(s, rates=rates)), how


def _capacity_request(suite: Suite, chunk_tokens: int, devices: int, rates) -> PlanRequest:
    s = suite.sweep
    workload = Workload(prompt=Fixed(value=s.prompt_len), output=Fixed(value=s.output_len),
                        arrivals=Poisson(rate=1.0), requests=400)
    return PlanRequest(devices=devices, workload=workload, slo_ttft_s=suite.slo_ttft_s, slo_tpot_s=suite.slo_tpot_s,
                       target=suite.target, rates=tuple(rates) if rates else None, chunk_tokens=chunk_tokens)


def _with_pool(profile: Profile, pool_bytes: int) -> Profile:
    return profile.model_copy(update={"serving": profile.serving.model_copy(update={"kv_pool_bytes": pool_bytes})})
