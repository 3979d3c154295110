"""The prefix-cache benchmark: the multi-turn workload against deployment variants, one after another
on this machine, into one report (docs/benchmarks/prefix-cache).

Variants, for 1P1D and 2P2D: the cache off; on (least-loaded routing, every prompt prefilled by a
prefill worker); on with KV-aware routing; on with KV-aware routing and conditional disaggregation
(a decode worker lacking at most `threshold` prompt tokens prefills them itself). And co-located
replicas (2) with the cache off and on with KV-aware routing. The targets the report checks, on turns
>= 2, against the same layout with the cache off: TTFT p50 at least 50% lower, KV bytes moved per
request at least 70% lower.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import shlex
import sys
import tempfile

import yaml

from clients.bench.multiturn import MultiTurn, make_turns_client, run_multiturn
from clients.bench.multiturn_report import multiturn_table, summarize_multiturn, turns_json
from clients.bench.bench_report import write_json
from ops.serve_process import ServeProcess

LAYOUTS = {"1P1D": ("--prefill", "1", "--decode", "1"), "2P2D": ("--prefill", "2", "--decode", "2")}
TARGETS = {"ttft_p50_reduction": 0.5, "kv_bytes_reduction": 0.7}
GROUP = "turns >= 2"


def variants(threshold: int) -> dict[str, tuple[tuple[str, ...], dict]]:
    """label -> (serve flags, deployment file)."""
    off = {"prefix_cache": {"enabled": False}, "local_prefill_tokens": 0}
    out = {}
    for layout, flags in LAYOUTS.items():
        out[f"{layout} cache off"] = (flags, off)
        out[f"{layout} cache on"] = (flags, {"local_prefill_tokens": 0})
        out[f"{layout} cache + kv-aware"] = (flags, {"local_prefill_tokens": 0, "router": "kv-aware"})
        out[f"{layout} cache + kv-aware + conditional"] = (flags, {"local_prefill_tokens": threshold,
                                                                   "router": "kv-aware"})
    colocated = ("--mode", "colocated", "--replicas", "2")
    out["colocated x2 cache off"] = (colocated, {"prefix_cache": {"enabled": False}})
    out["colocated x2 cache + kv-aware"] = (colocated, {"router": "kv-aware"})
    return out


def run_prefix_suite(engines: str, out: str, spec: MultiTurn, protocol: str, threshold: int, kv_pool_bytes: int,
                     slo: tuple[float, float], tokenizer, only: list[str] | None = None, log=print) -> dict:
    work = tempfile.mkdtemp(prefix="tandem-prefix-")
    chosen = {k: v for k, v in variants(threshold).items() if not only or k in only}
    runs = {}
    for i, (label, (flags, config)) in enumerate(chosen.items()):
        folder = os.path.join(work, f"v{i}")
        os.makedirs(folder)
        with open(os.path.join(folder, "deployment.yaml"), "w") as f:
            yaml.safe_dump(config, f)
        log(f"[{label}] starting tandem serve (logs in {folder}) ...")
        serve = ServeProcess(folder, ("--model", engines, "--kv-pool-bytes", str(kv_pool_bytes), *flags,
                                      "--config", os.path.join(folder, "deployment.yaml"))).start()
        try:
            runs[label] = asyncio.run(_one(spec, protocol, serve, tokenizer))
        finally:
            code = serve.stop()
            if code != 0:
                log(f"[{label}] tandem serve exited with {code}")
    return _report(runs, chosen, out, spec, protocol, threshold, kv_pool_bytes, slo)


async def _one(spec: MultiTurn, protocol: str, serve: ServeProcess, tokenizer) -> dict:
    client = make_turns_client(protocol, serve.grpc if protocol == "grpc" else serve.http)
    try:
        return await run_multiturn(spec, client, tokenizer, metrics_url=serve.http)
    finally:
        await client.close()


def versus_off(summaries: dict) -> dict:
    """Per cached variant, on turns >= 2: reductions against the same layout with the cache off."""
    out = {}
    for label, s in summaries.items():
        layout = label.split(" cache")[0]
        base = summaries.get(f"{layout} cache off")
        if base is None or label == f"{layout} cache off" or "error" in s[GROUP] or "error" in base[GROUP]:
            continue
        a, b = s[GROUP], base[GROUP]
        row = {"ttft_p50_reduction": 1 - a["ttft_p50_s"] / b["ttft_p50_s"]}
        if b.get("kv_bytes_per_request"):
            row["kv_bytes_reduction"] = 1 - a["kv_bytes_per_request"] / b["kv_bytes_per_request"]
        row["meets_targets"] = all(row.get(k, 1.0) >= v for k, v in TARGETS.items())
        out[label] = row
    return out


def _report(runs: dict, chosen: dict, out: str, spec: MultiTurn, protocol: str, threshold: int, kv_pool_bytes: int,
            slo: tuple[float, float]) -> dict:
    summaries = {label: summarize_multiturn(run, *slo) for label, run in runs.items()}
    vs = versus_off(summaries)
    doc = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform()},
           "workload": spec.to_dict(), "protocol": protocol, "local_prefill_tokens": threshold,
           "kv_pool_bytes": kv_pool_bytes, "slo": {"ttft_s": slo[0], "tpot_s": slo[1]}, "targets": TARGETS,
           "variants": {k: {"serve_flags": list(v[0]), "deployment": v[1]} for k, v in chosen.items()},
           "summary": summaries, "versus_cache_off": vs,
           "runs": {k: {"rounds": r["rounds"], "turns": turns_json(r["turns"])} for k, r in runs.items()}}
    md = ["# Prefix cache, KV-aware routing and conditional disaggregation\n",
          f"Command: `{doc['command']}`  \nDate: {doc['date']}  \nMachine: {doc['machine']['cpus']} cores, "
          f"{doc['machine']['platform']}  \nWorkload: {spec.conversations} conversations x {spec.turns} turns, "
          f"{spec.system_tokens}-token shared system prompt, {spec.user_tokens}-token user messages, "
          f"{spec.answer_tokens}-token answers; protocol {protocol}; conditional threshold {threshold} tokens; "
          f"SLO for goodput: TTFT <= {slo[0] * 1e3:.0f} ms, TPOT <= {slo[1] * 1e3:.0f} ms.\n"]
    for group in ("turns >= 2", "turn 1", "all"):
        md += [f"## {group}\n", multiturn_table(summaries, group), ""]
    md.append("## Against the cache off (turns >= 2; targets: TTFT p50 >= 50% lower, KV bytes >= 70% lower)\n")
    for label, r in vs.items():
        kv = f", KV bytes/request {r['kv_bytes_reduction']:.0%} lower" if "kv_bytes_reduction" in r else ""
        md.append(f"- {label}: TTFT p50 {r['ttft_p50_reduction']:.0%} lower{kv}: "
                  f"{'meets' if r['meets_targets'] else 'misses'} the targets")
    write_json(os.path.join(out, "report.json"), doc)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return doc
