"""`tandem bench compare`: the same scenarios against disaggregated, co-located and chunked serving,
one deployment after another on this machine, into one report (JSON, Markdown, plots).

Each mode gets the same cores: disaggregated pins the prefill worker and the decode worker to
separate cores; the co-located modes run one worker on all of them.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import shlex
import sys
import tempfile

from orchestrator.bench import plots
from orchestrator.bench.drivers import make_driver
from orchestrator.bench.report import records_json, table, write_json
from orchestrator.bench.runner import run_scenario
from orchestrator.bench.stats import summarize
from orchestrator.bench.workload import SCENARIOS
from orchestrator.serve_process import ServeProcess

MODES = ("disaggregated", "colocated", "chunked")
BASELINE = "colocated"


def run_compare(engines: str, out: str, scenarios: list[str], modes: list[str], protocol: str, slo_ttft: float,
                slo_tpot: float, kv_pool_bytes: int, chunk_tokens: int, tokenizer, log=print) -> dict:
    runs = {s: {} for s in scenarios}
    work = tempfile.mkdtemp(prefix="tandem-compare-")
    for mode in modes:
        log(f"[{mode}] starting tandem serve (logs in {work}/{mode}) ...")
        serve = ServeProcess(os.path.join(work, mode), (
            "--model", engines, "--mode", mode, "--kv-pool-bytes", str(kv_pool_bytes),
            "--chunk-tokens", str(chunk_tokens))).start()
        try:
            for name in scenarios:
                log(f"[{mode}] scenario {name}")
                runs[name][mode] = asyncio.run(_one(SCENARIOS[name], protocol, serve, tokenizer))
        finally:
            code = serve.stop()
            if code != 0:
                log(f"[{mode}] tandem serve exited with {code}")
    return _report(runs, out, protocol, slo_ttft, slo_tpot, chunk_tokens)


async def _one(scenario, protocol: str, serve: ServeProcess, tokenizer):
    driver = make_driver(protocol, serve.grpc if protocol == "grpc" else serve.http)
    try:
        return await run_scenario(scenario, driver, tokenizer)
    finally:
        await driver.close()


def _ratios(modes: dict) -> dict:
    base = modes.get(BASELINE)
    out = {}
    for mode, s in modes.items():
        if mode == BASELINE or not base or "error" in s or "error" in base:
            continue
        out[mode] = {"ttft_p50_reduction": 1 - s["ttft_s"]["p50"] / base["ttft_s"]["p50"],
                     "e2e_p50_reduction": 1 - s["e2e_s"]["p50"] / base["e2e_s"]["p50"],
                     "itl_p99_ratio": s["itl_s"]["p99"] / base["itl_s"]["p99"],
                     "goodput_ratio": s["goodput_rps"] / base["goodput_rps"] if base["goodput_rps"] else float("inf")}
    return out


def _change(reduction: float) -> str:
    return f"{reduction:.0%} lower" if reduction >= 0 else f"{-reduction:.0%} higher"


def _report(runs: dict, out: str, protocol: str, slo_ttft: float, slo_tpot: float, chunk_tokens: int,
            command: str | None = None) -> dict:
    doc = {"command": command or "tandem " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                       "processor": platform.processor() or platform.machine()},
           "protocol": protocol, "chunk_tokens": chunk_tokens, "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
           "scenarios": {}}
    md = ["# Disaggregated vs co-located vs chunked prefill\n",
          f"Command: `{doc['command']}`  \nDate: {doc['date']}  \nMachine: {doc['machine']['cpus']} cores, "
          f"{doc['machine']['platform']}  \nProtocol: {protocol}; SLO for goodput: TTFT <= {slo_ttft * 1e3:.0f} ms, "
          f"TPOT <= {slo_tpot * 1e3:.0f} ms; chunked prefill budget {chunk_tokens} tokens per step.\n"]
    for name, modes in runs.items():
        scenario = SCENARIOS[name]
        summaries = {m: summarize(r, slo_ttft, slo_tpot) for m, r in modes.items()}
        doc["scenarios"][name] = {"description": scenario.description, "definition": scenario.to_dict(),
                                  "summary": summaries, "vs_colocated": _ratios(summaries),
                                  "records": {m: records_json(r) for m, r in modes.items()}}
        md += [f"## {name}: {scenario.description}\n", "All requests (after warm-up):\n", table(summaries), ""]
        if len(scenario.streams) > 1:
            for stream in scenario.streams:
                per = {m: summarize(r, slo_ttft, slo_tpot, [stream.name]) for m, r in modes.items()}
                doc["scenarios"][name].setdefault("per_stream", {})[stream.name] = per
                md += [f"Stream `{stream.name}` only:\n", table(per), ""]
        for mode, r in _ratios(summaries).items():
            md.append(f"- {mode} vs {BASELINE}: TTFT p50 {_change(r['ttft_p50_reduction'])}, E2E p50 "
                      f"{_change(r['e2e_p50_reduction'])}, ITL p99 x{r['itl_p99_ratio']:.2f}, "
                      f"goodput x{r['goodput_ratio']:.2f}")
        md.append("")
        for kind in ("ttft", "itl"):
            plots.cdf(modes, kind, os.path.join(out, f"{name}-{kind}-cdf.png"), f"{name}: {kind.upper()} CDF")
            md.append(f"![{name} {kind} CDF]({name}-{kind}-cdf.png)")
        plots.timeline(modes, os.path.join(out, f"{name}-timeline.png"), f"{name}: token timeline per request")
        md += [f"![{name} timeline]({name}-timeline.png)", ""]
    write_json(os.path.join(out, "report.json"), doc)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return doc
