"""`tandem bench compare`: the same scenarios against serving layouts on equal hardware, one
deployment after another on this machine, into one report (JSON, Markdown, plots).

Every layout gets the same cores (layouts.py): x prefill + y decode workers with one core each
(xPyD), N co-located replicas with one core each (`colocated Nx1`), one co-located worker on all of
them (`colocated 1xN`), and the same two with chunked prefill. The cores each worker was pinned to
are read back from the serve workdir and recorded. Ratios are against the baseline layout.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
import tempfile

from clients.bench import bench_plots as plots
from clients.bench.bench_layouts import ServeSettings
from clients.bench.bench_report import records_json, table, write_json
from clients.bench.stats import summarize
from clients.bench.suite import run_layout
from clients.bench.bench_workload import SCENARIOS
from planner.sim.sim_layouts import Layout


def baseline_of(layouts: list[Layout]) -> str | None:
    """The co-located worker on all the cores if it is compared, else the first co-located layout."""
    colocated = [x for x in layouts if x.kind == "colocated"]
    pick = [x for x in colocated if x.workers == 1] or colocated
    return pick[0].name if pick else None


def run_compare(out: str, scenarios: list[str], layouts: list[Layout], cpus: list[int], protocol: str,
                slo_ttft: float, slo_tpot: float, settings: ServeSettings, tokenizer, log=print) -> dict:
    work = tempfile.mkdtemp(prefix="tandem-compare-")
    runs = {s: {} for s in scenarios}
    pinning = {}
    for layout in layouts:
        done = run_layout([SCENARIOS[s] for s in scenarios], layout, cpus, settings, protocol, tokenizer, work, log)
        pinning[layout.name] = done["pinning"]
        for name, records in done["runs"].items():
            runs[name][layout.name] = records
    return _report(runs, out, protocol, slo_ttft, slo_tpot, settings, pinning, baseline_of(layouts))


def _ratios(summaries: dict, baseline: str | None) -> dict:
    base = summaries.get(baseline)
    out = {}
    for name, s in summaries.items():
        if name == baseline or not base or "error" in s or "error" in base:
            continue
        out[name] = {"ttft_p50_reduction": 1 - s["ttft_s"]["p50"] / base["ttft_s"]["p50"],
                     "e2e_p50_reduction": 1 - s["e2e_s"]["p50"] / base["e2e_s"]["p50"],
                     "itl_p99_ratio": s["itl_s"]["p99"] / base["itl_s"]["p99"],
                     "goodput_ratio": s["goodput_rps"] / base["goodput_rps"] if base["goodput_rps"] else float("inf")}
    return out


def _change(reduction: float) -> str:
    return f"{reduction:.0%} lower" if reduction >= 0 else f"{-reduction:.0%} higher"


def _report(runs: dict, out: str, protocol: str, slo_ttft: float, slo_tpot: float, settings: ServeSettings,
            pinning: dict, baseline: str | None, command: str | None = None) -> dict:
    os.makedirs(out, exist_ok=True)
    doc = {"command": command or "tandem " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                       "processor": platform.processor() or platform.machine()},
           "protocol": protocol, "chunk_tokens": settings.chunk_tokens, "kv_pool_bytes": settings.kv_pool_bytes,
           "limits": {"max_in_flight": settings.max_in_flight, "max_queued_tokens": settings.max_queued_tokens},
           "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot}, "pinning": pinning, "baseline": baseline,
           "scenarios": {}}
    md = ["# Serving layouts on equal hardware\n",
          f"Command: `{doc['command']}`  \nDate: {doc['date']}  \nMachine: {doc['machine']['cpus']} cores, "
          f"{doc['machine']['platform']}  \nProtocol: {protocol}; SLO for goodput: TTFT <= {slo_ttft * 1e3:.0f} ms, "
          f"TPOT <= {slo_tpot * 1e3:.0f} ms; chunked prefill budget {settings.chunk_tokens} tokens per step.  ",
          "Workers and their cores: " + "; ".join(f"{n}: {p}" for n, p in pinning.items()) + "\n"]
    for name, by_layout in runs.items():
        scenario = SCENARIOS[name]
        summaries = {x: summarize(r, slo_ttft, slo_tpot) for x, r in by_layout.items()}
        ratios = _ratios(summaries, baseline)
        doc["scenarios"][name] = {"description": scenario.description, "definition": scenario.to_dict(),
                                  "summary": summaries, "vs_baseline": ratios,
                                  "records": {x: records_json(r) for x, r in by_layout.items()}}
        md += [f"## {name}: {scenario.description}\n", "All requests (after warm-up):\n", table(summaries), ""]
        if len(scenario.streams) > 1:
            for stream in scenario.streams:
                per = {x: summarize(r, slo_ttft, slo_tpot, [stream.name]) for x, r in by_layout.items()}
                doc["scenarios"][name].setdefault("per_stream", {})[stream.name] = per
                md += [f"Stream `{stream.name}` only:\n", table(per), ""]
        for x, r in ratios.items():
            md.append(f"- {x} vs {baseline}: TTFT p50 {_change(r['ttft_p50_reduction'])}, E2E p50 "
                      f"{_change(r['e2e_p50_reduction'])}, ITL p99 x{r['itl_p99_ratio']:.2f}, "
                      f"goodput x{r['goodput_ratio']:.2f}")
        md.append("")
        for kind in ("ttft", "itl"):
            plots.cdf(by_layout, kind, os.path.join(out, f"{name}-{kind}-cdf.png"), f"{name}: {kind.upper()} CDF")
            md.append(f"![{name} {kind} CDF]({name}-{kind}-cdf.png)")
        plots.timeline(by_layout, os.path.join(out, f"{name}-timeline.png"), f"{name}: token timeline per request")
        md += [f"![{name} timeline]({name}-timeline.png)", ""]
    write_json(os.path.join(out, "report.json"), doc)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return doc
