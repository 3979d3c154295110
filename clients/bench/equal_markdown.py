"""The equal-hardware report's files: report.json (everything, every request's timings), report.md
(the tables) and the plots (attainment vs rate, and per seed burst the TTFT CDF and token timeline)."""

from __future__ import annotations

import os

from clients.bench import bench_plots as plots
from clients.bench.equal_report import QUIET_CORES
from clients.bench.bench_report import write_json
from clients.bench.slo import verdict


def write_report(doc: dict, results: dict, out: str) -> list[str]:
    """Write the files into `out`; returns their paths. results: {layout: {"runs": {scenario: records}}}."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "report.json"), os.path.join(out, "report.md"), os.path.join(out, "attainment.png")]
    write_json(paths[0], doc)
    plots.attainment(doc["sweep"], doc["plan"], paths[2], f"SLO attainment vs rate, {len(doc['cpus'])} cores "
                     f"(TTFT <= {doc['slo']['ttft_s'] * 1e3:g} ms, TPOT <= {doc['slo']['tpot_s'] * 1e3:g} ms)")
    for name in doc["seeds"]:
        runs = {x: results[x]["runs"][name] for x in results}
        for kind in ("ttft", "itl"):
            paths.append(os.path.join(out, f"{name}-{kind}-cdf.png"))
            plots.cdf(runs, kind, paths[-1], f"{name}: {kind.upper()} CDF")
        paths.append(os.path.join(out, f"{name}-timeline.png"))
        plots.timeline(runs, paths[-1], f"{name}: token timeline per request")
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(markdown(doc))
    return paths


def markdown(doc: dict) -> str:
    m, slo = doc["machine"], doc["slo"]
    lines = [f"# Equal hardware: disaggregated vs co-located on {len(doc['cpus'])} cores ({doc['suite']})", "",
             f"Command: `{doc['command']}`  ", f"Date: {doc['date']}  ",
             f"Machine: {m['platform']}, {m['cpus_on_machine']} cores, cores used {doc['cpus']}; load average "
             f"{m['load_before']} before, {m['load_after']} after{'; ' + m['note'] if m.get('note') else ''}  ",
             f"Profile: {doc['profile']['name']} ({_measured(doc['profile'])}), handoff "
             f"{doc['profile']['handoff_gbytes_per_s']:.3g} GB/s  ",
             f"Deployment: KV pool {doc['kv_pool_bytes'] / 2 ** 30:g} GiB per KV-owning worker (the largest seed burst "
             f"needs {doc['kv_need_bytes'] / 2 ** 30:.2f} GiB on one worker), limits {doc['limits']}, chunked prefill "
             f"{doc['chunk_tokens']} tokens per step  ",
             f"SLO: TTFT <= {slo['ttft_s'] * 1e3:g} ms and TPOT <= {slo['tpot_s'] * 1e3:g} ms; sustained rate at "
             f"{slo['target']:.0%} attainment", "",
             "## Layouts (each worker's cores, from the serve workdir's workers.json)", "",
             "| layout | cores | workers: cores |", "|---|---|---|"]
    for name, x in doc["layouts"].items():
        lines.append(f"| {name} | {x['cores']} | " + ", ".join(f"{w}: {c}" for w, c in x["pinning"].items()) + " |")
    for name, claims in doc["seeds"].items():
        lines += _seed(name, doc["scenarios"][name], claims)
    lines += _sweep(doc) + _validation(doc)
    return "\n".join(lines) + "\n"


def _measured(p: dict) -> str:
    return f"measured {p['measured']['date']} by `{p['measured']['command']}`" if p["measured"] else "hand-written"


def _seed(name: str, sc: dict, claims: list[dict]) -> list[str]:
    lines = ["", f"## {name}: {sc['description']}", "", "Measured, and predicted by the simulator for the same "
             "requests (total = first send to last token):", "", *_pairs(sc), "",
             "Against the claim (reductions: 1 - disaggregated / co-located; total = the burst's makespan):", "",
             "| disaggregated | vs | TTFT p50 | TTFT mean | total | predicted TTFT mean | predicted total | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in claims:
        m, p = c["measured"], c["predicted"]
        cells = [_red(m, "ttft_p50_reduction"), _red(m, "ttft_mean_reduction"), _red(m, "total_reduction"),
                 _red(p, "ttft_mean_reduction"), _red(p, "total_reduction"), verdict(m) if m else "a run failed"]
        lines.append(f"| {c['disaggregated']} | {c['baseline']} | " + " | ".join(cells) + " |")
    lines += ["", f"![{name} TTFT CDF]({name}-ttft-cdf.png) ![{name} ITL CDF]({name}-itl-cdf.png)",
              f"![{name} timeline]({name}-timeline.png)"]
    return lines


PAIR_COLUMNS = (("TTFT p50", "ttft_s", "p50"), ("TTFT mean", "ttft_s", "mean"), ("TTFT p99", "ttft_s", "p99"),
                ("ITL p50", "itl_s", "p50"), ("ITL p99", "itl_s", "p99"), ("E2E p50", "e2e_s", "p50"))


def _pairs(sc: dict) -> list[str]:
    """One row measured and one predicted per layout: latencies in ms, total in s, attainment."""
    lines = ["| layout | | " + " | ".join(f"{c} ms" for c, *_ in PAIR_COLUMNS) + " | total s | attainment | failed |",
             "|---|---|" + "---|" * (len(PAIR_COLUMNS) + 3)]
    for layout, m in sc["summary"].items():
        p = sc["predicted"][layout]
        for label, s, att, failed in (("measured", m, m.get("met_slo", 0) / m["requests"], m.get("failed", 0)),
                                      ("predicted", p, p["slo_attainment"], p["refused"])):
            if "error" in s:
                lines.append(f"| {layout} | {label} | {s['error']} |" + " |" * (len(PAIR_COLUMNS) + 2))
                continue
            cells = [_ms(s[k][q]) for _, k, q in PAIR_COLUMNS] + [f"{s['window_s']:.1f}", f"{att:.0%}", str(failed)]
            lines.append(f"| {layout} | {label} | " + " | ".join(cells) + " |")
    return lines


def _red(change: dict | None, key: str) -> str:
    return "-" if change is None else f"{-change[key]:+.0%}"


def _sweep(doc: dict) -> list[str]:
    sw, plan = doc["sweep"], doc["plan"]
    rates = sw["rates"]
    plan_att = {(r["layout"], r["rate"]): r["metrics"]["slo_attainment"] for r in plan["results"]}
    how = doc.get("sweep_rates") or {}
    chosen = ("" if not how else
              f"Rates: {', '.join(f'{f:g}' for f in how['around'])} x {how['center']:.3g} req/s, the mean capacity "
              f"`tandem plan` predicted on {_chosen_on(how, doc)} before the runs ("
              + ", ".join(f"{n} {r:.3g}" for n, r in how["predicted_capacity"].items()) + "). ")
    lines = ["", "## SLO attainment vs Poisson rate", "", chosen + "measured / predicted (same requests) / "
             "`tandem plan` (own draws, >= 30 s of arrivals per point):", "",
             "| layout | " + " | ".join(f"{r:g} req/s" for r in rates) + " | sustained at target: measured / "
             "predicted / plan |", "|---|" + "---|" * (len(rates) + 1)]
    for name in sw["measured"]:
        cells = [f"{sw['measured'][name][r]:.0%} / {sw['predicted'][name][r]:.0%} / "
                 f"{plan_att.get((name, r), float('nan')):.0%}" for r in rates]
        s = sw["sustained"][name]
        ps = plan["sustained"].get(name, {})
        cells.append(f"{_rate(s['measured'])} / {_rate(s['predicted'])} / {_rate(ps) if ps else '-'}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + ["", "![attainment vs rate](attainment.png)"]


def _rate(s: dict) -> str:
    return f"{s['rate']:.3g}" + ("+" if s["beyond_range"] else "")


def _validation(doc: dict) -> list[str]:
    v = doc["validation_summary"]
    lines = ["", "## Validation: the planner's simulator against every measured run", "",
             f"Same requests replayed (send times, lengths) on the same layout. Targets: p50 TTFT and p50 ITL within "
             f"+-20%, attainment within 10 points. Met: {_met(v)} of all runs; {_met(v['quiet'])} of the quiet "
             f"ones (other processes used <= {QUIET_CORES:g} cores meanwhile).", "",
             "| layout | run | others, cores | TTFT p50 ms measured / predicted | error | ITL p50 ms measured / "
             "predicted | error | attainment measured / predicted | points |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["validation"]:
        m, p, ok = r["measured"], r["predicted"], r["within"]
        others = "-" if r["others_cores"] is None else f"{r['others_cores']:.2f}"
        lines.append(f"| {r['layout']} | {r['scenario']} | {others} | {_ms(m['ttft_p50_s'])} / "
                     f"{_ms(p['ttft_p50_s'])} | "
                     f"{_err(r['ttft_p50_rel'], ok['ttft_p50_rel'])} | {_ms(m['itl_p50_s'])} / {_ms(p['itl_p50_s'])} | "
                     f"{_err(r['itl_p50_rel'], ok['itl_p50_rel'])} | {m['attainment']:.0%} / {p['attainment']:.0%} | "
                     f"{r['attainment_points'] * 100:+.0f}{'' if ok['attainment_points'] else ' (miss)'} |")
    return lines


def _met(v: dict) -> str:
    return (f"TTFT {v['ttft_p50_rel']}/{v['rows']}, ITL {v['itl_p50_rel']}/{v['rows']}, attainment "
            f"{v['attainment_points']}/{v['rows']}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _err(rel: float | None, ok: bool) -> str:
    return "-" if rel is None else f"{rel:+.0%}" + ("" if ok else " (miss)")


def _chosen_on(how: dict, doc: dict) -> str:
    """The profile the rates were chosen on: this report's, or (a report rebuilt with another) that file."""
    chosen = how.get("profile_file")
    return "this profile" if chosen in (None, doc["profile_file"]) else f"`{chosen}`"
