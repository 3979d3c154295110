#!/usr/bin/env python3
"""Push vs pull KV handoff, side by side in one run: the same xPyD deployment served once per mode,
the same workloads through the gRPC front door, and the pools sampled while they run.

    python scripts/bench_handoff_modes.py --engines engines/smollm2-135m --out docs/benchmarks/handoff-modes
        [--layout 1x1] [--layout 2x2] [--scenarios seed-16x256-64,stall]

Per mode and workload it reports TTFT p50/p99 and ITL p99 as the client saw them; the decode-side
wait for the KV (`tandem_kv_wait_seconds`: push, the writes still landing after prefill compute;
pull, first token until the decode worker's read is done); and the KV pages held over time by the
prefill and decode pools (`tandem_kv_pages_used`, sampled every 0.2 s: prefill pages in pull are the
holds, plus the request in its pass; decode pages in push include reservations waiting for their
prefill). Everything is a wall-clock time on this machine: read the two modes against each other,
not against another machine. Writes report.json and report.md into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clients.bench.bench_workload import SCENARIOS, warmup_scenario  # noqa: E402
from clients.bench.drivers import make_driver  # noqa: E402
from clients.bench.runner import run_scenario  # noqa: E402
from clients.bench.stats import dist, percentile  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from ops.serve_process import ServeProcess  # noqa: E402

MODES = ("push", "pull")
# the exposition orders labels by name (role before worker); the pattern takes either order
_PAGES = re.compile(r'^tandem_kv_pages_(used|held)\{(?=[^}]*role="(\w+)")[^}]*\} ([\d.e+-]+)', re.M)
_WAIT = re.compile(r'^tandem_kv_wait_seconds_(sum|count)\{handoff="(\w+)"\} ([\d.e+-]+)', re.M)


def scrape(http: str) -> str:
    with urllib.request.urlopen(http + "/metrics", timeout=10) as r:
        return r.read().decode()


def wait_totals(text: str) -> dict[str, float]:
    return {f"{kind}": float(v) for kind, _mode, v in _WAIT.findall(text)}


async def sample_pages(http: str, every_s: float, out: list, stop: asyncio.Event) -> None:
    """(seconds, {role: pages used summed over its workers}) every `every_s` until `stop`."""
    t0 = time.perf_counter()
    while not stop.is_set():
        text = await asyncio.to_thread(scrape, http)
        roles: dict[str, float] = {}
        for kind, role, v in _PAGES.findall(text):
            key = role if kind == "used" else f"{role}_held"  # prefill_held: the pull holds
            roles[key] = roles.get(key, 0.0) + float(v)
        out.append((time.perf_counter() - t0, roles))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def measure(serve: ServeProcess, scenario, tokenizer) -> dict:
    before = wait_totals(await asyncio.to_thread(scrape, serve.http))
    samples: list = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_pages(serve.http, 0.2, samples, stop))
    driver = make_driver("grpc", serve.grpc)
    try:
        records = await run_scenario(scenario, driver, tokenizer, show_progress=False)
    finally:
        await driver.close()
        stop.set()
        await sampler
    after = wait_totals(await asyncio.to_thread(scrape, serve.http))
    ok = [r for r in records if r.ok and not r.warmup]
    n = after.get("count", 0) - before.get("count", 0)
    pages = {role: [s[1].get(role, 0.0) for s in samples] for role in ("prefill", "prefill_held", "decode")}
    return {
        "requests": len([r for r in records if not r.warmup]), "failed": sum(1 for r in records if not r.ok),
        "ttft_s": dist([r.ttft for r in ok]), "itl_s": dist([g for r in ok for g in r.gaps]),
        "kv_wait_mean_s": (after.get("sum", 0) - before.get("sum", 0)) / n if n else None, "kv_waits": n,
        "pages": {role: {"mean": sum(v) / len(v) if v else 0.0, "p99": percentile(v, 99), "max": max(v, default=0.0)}
                  for role, v in pages.items()},
        "pages_over_time": [[round(t, 2), s.get("prefill", 0.0), s.get("prefill_held", 0.0), s.get("decode", 0.0)]
                            for t, s in samples],  # [seconds, prefill used, of them held for a reader, decode used]
    }


def serve_args(engines: str, mode: str, prefill: int, decode: int, kv_pool_bytes: int) -> tuple[str, ...]:
    return ("--model", engines, "--handoff", mode, "--prefill", str(prefill), "--decode", str(decode),
            "--kv-pool-bytes", str(kv_pool_bytes))


async def one_mode(engines: str, mode: str, layout: tuple[int, int], scenarios: list, kv_pool_bytes: int,
                   workdir: str, tokenizer) -> dict:
    serve = ServeProcess(os.path.join(workdir, f"{mode}-{layout[0]}p{layout[1]}d"),
                         serve_args(engines, mode, *layout, kv_pool_bytes)).start()
    try:
        warm = make_driver("grpc", serve.grpc)
        try:
            await run_scenario(warmup_scenario(sum(layout)), warm, tokenizer, show_progress=False)
        finally:
            await warm.close()
        out = {}
        for sc in scenarios:
            print(f"[{mode} {layout[0]}P{layout[1]}D] {sc.name} ...", flush=True)
            out[sc.name] = await measure(serve, sc, tokenizer)
        return out
    finally:
        code = serve.stop()
        if code != 0:
            print(f"[{mode}] tandem serve exited with {code}", file=sys.stderr)


def _load(avg) -> str:
    return " / ".join(f"{x:.1f}" for x in avg)


def markdown(doc: dict) -> str:
    lines = ["# Push vs pull KV handoff", "", f"Command: `{doc['command']}`", "",
             "All numbers are wall-clock on this machine, both modes in one run (read them side by side). "
             f"Load average (1/5/15 min) at the start {_load(doc['load_average_start'])}, at the end "
             f"{_load(doc['load_average_end'])}.", "",
             "| layout | workload | mode | failed | TTFT p50 s | TTFT p99 s | ITL p99 s | decode wait for KV, mean s "
             "| prefill pages mean / max | of them held, mean / max | decode pages mean / max |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for layout, modes in doc["layouts"].items():
        for sc in doc["scenarios"]:
            for mode in MODES:
                r = modes[mode][sc]
                wait = f"{r['kv_wait_mean_s']:.4f}" if r["kv_wait_mean_s"] is not None else "n/a"
                p, h, d = r["pages"]["prefill"], r["pages"]["prefill_held"], r["pages"]["decode"]
                lines.append(f"| {layout} | {sc} | {mode} | {r['failed']} | {r['ttft_s']['p50']:.3f} | "
                             f"{r['ttft_s']['p99']:.3f} | {r['itl_s']['p99']:.3f} | {wait} | "
                             f"{p['mean']:.1f} / {p['max']:.0f} | {h['mean']:.1f} / {h['max']:.0f} | "
                             f"{d['mean']:.1f} / {d['max']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", required=True, help="Built engines (tandem build --out ...).")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", action="append", default=None, help="PxD, e.g. 1x1 (repeatable; default 1x1).")
    ap.add_argument("--scenarios", default="seed-16x256-64,stall")
    ap.add_argument("--kv-pool-bytes", type=int, default=256 << 20)
    args = ap.parse_args()
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        sys.exit(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}")
    layouts = [tuple(int(x) for x in s.split("x")) for s in (args.layout or ["1x1"])]
    tokenizer = Tokenizer(os.path.join(args.engines, "prefill"))
    workdir = tempfile.mkdtemp(prefix="tandem-handoff-modes-")
    doc = {"command": " ".join(["python scripts/bench_handoff_modes.py", *sys.argv[1:]]), "scenarios": names,
           "layouts": {}, "load_average_start": os.getloadavg()}  # 1, 5, 15 min: the machine may be shared
    for p, d in layouts:
        doc["layouts"][f"{p}P{d}D"] = {mode: asyncio.run(one_mode(args.engines, mode, (p, d), [SCENARIOS[n] for n in names],
                                                                 args.kv_pool_bytes, workdir, tokenizer))
                                       for mode in MODES}
    doc["load_average_end"] = os.getloadavg()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
