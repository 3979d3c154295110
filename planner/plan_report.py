"""`tandem plan`'s output folder: plan.json (everything), plan.md (the tables behind the
recommendation) and plan.png (SLO attainment vs rate per layout, or vs devices when sizing)."""

from __future__ import annotations

import json
import os

from planner.plan_workload import Workload, describe_length, describe_priorities


def write_report(doc: dict, out: str) -> list[str]:
    """Write the three files into folder `out` (created if needed); returns their paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, n) for n in ("plan.json", "plan.md", "plan.png")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(markdown(doc))
    from planner.plan_plots import plot_plan  # matplotlib is imported only when a plot is drawn

    plot_plan(doc, paths[2])
    return paths


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _header(doc: dict) -> list[str]:
    w, slo = doc["workload"], doc["slo"]
    arr = w["arrivals"]
    load = ("Poisson arrivals at each rate below" if doc["mode"] == "capacity"
            else f"Poisson arrivals at {arr['rate']:g} req/s" if arr["kind"] == "poisson"
            else f"a closed loop of {arr['concurrency']} clients")
    wl = Workload.model_validate({**w, "arrivals": {"kind": "closed", "concurrency": 1}})
    prof = doc["profile"]
    fits = ", ".join(f"{ph} {err:.0%}" for ph, err in prof["fit_error_max"].items() if err is not None)
    return [
        f"# {'Capacity' if doc['mode'] == 'capacity' else 'Sizing'} plan: {doc['profile']['name']}, "
        f"{'up to ' if doc['mode'] == 'sizing' else ''}{doc['devices']} devices", "",
        f"- Hardware: {prof['hardware'].get('device')}; model: {prof['model']}; handoff "
        f"{prof['handoff_gbytes_per_s']:.3g} GB/s; front door +{prof['frontdoor']['ttft_s'] * 1e3:g} ms TTFT, "
        f"+{prof['frontdoor']['per_token_s'] * 1e3:g} ms per token; {_served(prof.get('served', []))}"
        + (f"; largest fit error on the profile's points: {fits}" if fits else ""),
        f"- Workload: prompts {describe_length(wl.prompt)} tokens, outputs {describe_length(wl.output)} tokens, "
        f"{w['requests']} requests per simulation"
        + (f" or {doc['min_duration_s']:g} s of arrivals, whichever is more" if w["arrivals"]["kind"] == "poisson" else "")
        + f" (seed {w['seed']}), {load}"
        + (f"; priority classes {describe_priorities(wl.priorities)}" if wl.priorities else ""),
        f"- SLO: TTFT <= {slo['ttft_s'] * 1e3:g} ms and TPOT <= {slo['tpot_s'] * 1e3:g} ms for >= "
        f"{slo['target_attainment']:.0%} of requests"
        + ("" if slo.get("priority") is None else f" of priority <= {slo['priority']} (the others best effort)")
        + f"; chunked prefill: {doc['chunk_tokens']} tokens per step", "",
    ]


def markdown(doc: dict) -> str:
    lines = _header(doc)
    rec = doc["recommendation"]
    if rec["layout"] is None:
        lines += [f"**No recommendation**: {rec['reason']}.", ""]
    elif doc["mode"] == "capacity":
        lines += [f"**Recommendation: {rec['layout']}**: sustains {rec['rate']:.3g} req/s "
                  f"({rec['per_device']:.3g} per device). {rec['reason']}."]
        if "disaggregated_vs_colocated" in rec:
            lines += [f"Best disaggregated ({rec['best_disaggregated']}) vs best co-located ({rec['best_colocated']}): "
                      f"{rec['disaggregated_vs_colocated']:.2f}x the sustained rate."]
        lines.append("")
    else:
        lines += [f"**Recommendation: {rec['layout']} on {rec['devices']} device(s)** "
                  f"({rec['slo_attainment']:.0%} attainment): {rec['reason']}.", ""]
    lines += _capacity_tables(doc) if doc["mode"] == "capacity" else _sizing_table(doc)
    lines += _classes_table(doc)
    if doc["skipped_layouts"]:
        lines += ["", "Skipped layouts:", ""] + [f"- {k}: {v}" for k, v in doc["skipped_layouts"].items()]
    return "\n".join(lines) + "\n"


def _capacity_tables(doc: dict) -> list[str]:
    target = doc["slo"]["target_attainment"]
    lines = [f"| layout | sustained req/s at {target:.0%} | per device | highest rate meeting it | attainment there "
             f"| TTFT p90 ms | TPOT p90 ms | ITL p99 ms | goodput req/s (rate x attainment) |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_layout: dict[str, list[dict]] = {}
    for r in doc["results"]:
        by_layout.setdefault(r["layout"], []).append(r)
    for name, rows in sorted(by_layout.items(), key=lambda kv: -doc["sustained"][kv[0]]["rate"]):
        s = doc["sustained"][name]
        at = _highest_meeting(rows, target)
        m = at["metrics"] if at else {}
        rate = f"{s['rate']:.3g}" + ("+" if s["beyond_range"] else "")
        lines.append(f"| {name} | {rate} | {s['per_device']:.3g} | {at['rate']:g} | {m['slo_attainment']:.0%} | "
                     f"{_ms(m['ttft_s']['p90'])} | {_ms(m['tpot_s']['p90'])} | {_ms(m['itl_s']['p99'])} | "
                     f"{at['rate'] * m['slo_attainment']:.3g} |" if at else f"| {name} | 0 | 0 | - | - | - | - | - | - |")
    rates = doc["rates"]
    lines += ["", "SLO attainment by rate (req/s):", "",
              "| layout | " + " | ".join(f"{r:g}" for r in rates) + " |",
              "|---|" + "---|" * len(rates)]
    for name, rows in by_layout.items():
        att = {r["rate"]: r["metrics"]["slo_attainment"] for r in rows}
        lines.append(f"| {name} | " + " | ".join(f"{att[r]:.0%}" for r in rates) + " |")
    return lines


def _sizing_table(doc: dict) -> list[str]:
    lines = ["| devices | layout | attainment | TTFT p50 / p90 ms | TPOT p50 / p90 ms | ITL p99 ms | E2E p90 ms "
             "| throughput req/s | goodput req/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        m = r["metrics"]
        if m.get("error"):
            lines.append(f"| {r['devices']} | {r['layout']} | 0% | refused: {m['error']} | | | | | |")
            continue
        lines.append(f"| {r['devices']} | {r['layout']} | {m['slo_attainment']:.0%} | {_ms(m['ttft_s']['p50'])} / "
                     f"{_ms(m['ttft_s']['p90'])} | {_ms(m['tpot_s']['p50'])} / {_ms(m['tpot_s']['p90'])} | "
                     f"{_ms(m['itl_s']['p99'])} | {_ms(m['e2e_s']['p90'])} | {m['throughput_rps']:.3g} | "
                     f"{m['goodput_rps']:.3g} |")
    return lines


def _recommended_row(doc: dict) -> dict | None:
    """The result the recommendation stands on: its layout at the highest rate meeting the target
    (capacity), or its layout on its device count (sizing)."""
    rec, target = doc["recommendation"], doc["slo"]["target_attainment"]
    if rec["layout"] is None:
        return None
    if doc["mode"] == "sizing":
        return next(r for r in doc["results"] if r["layout"] == rec["layout"] and r["devices"] == rec["devices"])
    return _highest_meeting([r for r in doc["results"] if r["layout"] == rec["layout"]], target)


def _highest_meeting(rows: list[dict], target: float) -> dict | None:
    """The row of the highest rate whose attainment meets `target` (None: none does)."""
    ok = [r for r in rows if r["metrics"]["slo_attainment"] >= target]
    return max(ok, key=lambda r: r["rate"]) if ok else None


def _classes_table(doc: dict) -> list[str]:
    """Each priority class alone at the recommended point (a workload of several classes)."""
    row = _recommended_row(doc)
    classes = row["metrics"].get("by_priority") if row else None
    if not classes:
        return []
    where = f" at {row['rate']:g} req/s" if "rate" in row else f" on {row['devices']} device(s)"
    lines = ["", f"Each priority class on {row['layout']}{where} (every class against the SLO's limits):", "",
             "| priority | requests | attainment | TTFT p50 / p90 ms | TPOT p50 / p90 ms | queue p90 ms |",
             "|---|---|---|---|---|---|"]
    for p, m in sorted(classes.items(), key=lambda kv: int(kv[0])):
        if m.get("error"):
            lines.append(f"| {p} | {m['requests']} | 0% | refused: {m['error']} | | |")
            continue
        lines.append(f"| {p} | {m['requests']} | {m['slo_attainment']:.0%} | {_ms(m['ttft_s']['p50'])} / "
                     f"{_ms(m['ttft_s']['p90'])} | {_ms(m['tpot_s']['p50'])} / {_ms(m['tpot_s']['p90'])} | "
                     f"{_ms(m['queue_s']['p90'])} |")
    return lines


def _served(fits: list[dict]) -> str:
    """What serving adds to a step, per worker shape (planner/served.py), or that the profile has none."""
    if not fits:
        return "no served step overhead measured (steps as the engine runs them alone)"
    return "served step overhead " + ", ".join(
        f"{f['role']} on {f['devices']} device(s) +{f['per_step_s'] * 1e3:.3g} ms per step "
        f"+{f['per_sequence_s'] * 1e3:.3g} ms per sequence" for f in fits)
