#!/usr/bin/env python3
"""Priority scheduling against first come, first served, side by side in one run: one 1P1D deployment
served twice (`--scheduling-policy priority`, then the default `fcfs`), the same workload through the
OpenAI door each time.

    python scripts/bench_priority.py --engines engines/smollm2-135m [--out docs/benchmarks/priority]
    python scripts/bench_priority.py --max-num-seqs 64 --kv-pool-bytes 79626240 --out docs/benchmarks/priority-pages

The workload: a closed loop of `batch` requests (8 clients, 384-token prompts, 48-token answers,
priority 10) keeps the prefill queue and the decode batch (`--max-num-seqs 4`) full, while `interactive`
requests (320-token prompts, 16-token answers, priority -10) arrive every 2.5 s. An interactive prompt is
too long to ride along in a batch prompt's pass (512 tokens on CPU), as a short one does under either
policy (a pass's fillers are the shortest waiting prompts). Under fcfs the same
requests are sent with priority 0 (that server refuses any other). Reported per stream: TTFT and
end-to-end p50/p90 as the client saw them. Wall-clock numbers of this machine: read the two policies
against each other. Writes report.json and report.md into --out when given.

Beside each measured row, the planner's prediction (`--profile`, default this 2-core machine's profile):
the simulator running the same workload on 1P1D with the run's decode batch and pool: the batch stream's
requests (prompt lengths as served, in the order sent) from 8 closed-loop clients, each interactive
request at the time it was sent.

The second command makes the decode pool, not the batch, what binds: 108 pages of 16 tokens hold four
batch requests (27 pages each), so an interactive one (21 pages) finds it full and, under the priority
policy, preempts a batch request (control/waiting_room.py); under fcfs it waits for pages with the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clients.bench.bench_workload import Scenario, Stream, warmup_scenario  # noqa: E402
from clients.bench.drivers import make_driver  # noqa: E402
from clients.bench.multiturn import read_counters  # noqa: E402
from clients.bench.runner import run_scenario  # noqa: E402
from clients.bench.stats import dist  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from ops.serve_process import ServeProcess  # noqa: E402
from planner.profile import Profile, load_profile  # noqa: E402
from planner.sim.sim_layouts import Layout  # noqa: E402
from planner.plan_workload import RequestSpec  # noqa: E402
from planner.sim.sim_metrics import summarize  # noqa: E402
from planner.sim.sim_run import SimRun, simulate  # noqa: E402

WORKLOAD = Scenario("priority", (
    Stream("batch", prompt_len=384, output_len=48, count=40, concurrency=8, priority=10),
    Stream("interactive", prompt_len=320, output_len=16, count=10, interval=2.5, start_after=4.0, priority=-10),
), warmup=2, seed=7, description="8 batch clients (384-token prompts, 48-token answers, priority 10) and an "
   "interactive request (320 / 16 tokens, priority -10) every 2.5 s")
POLICIES = ("priority", "fcfs")
STREAMS = ("interactive", "batch")
ONE_P_ONE_D = Layout("disaggregated", 1, 1)


async def run_policy(engines: str, policy: str, workdir: str, tokenizer, serve_args: tuple[str, ...],
                     profile: Profile) -> dict:
    """The workload against one serve of `policy` (and `serve_args`); per stream TTFT and E2E
    distributions (seconds), measured and predicted (`profile`: the deployment's)."""
    scenario = WORKLOAD if policy == "priority" else dataclasses.replace(
        WORKLOAD, streams=tuple(dataclasses.replace(s, priority=0) for s in WORKLOAD.streams))
    serve = ServeProcess(os.path.join(workdir, policy), ("--model", engines, "--scheduling-policy", policy,
                                                         *serve_args)).start()
    try:
        driver = make_driver("openai", serve.http)
        try:
            await run_scenario(warmup_scenario(2), driver, tokenizer, show_progress=False)
            print(f"[{policy}] {scenario.description} ...", flush=True)
            records = await run_scenario(scenario, driver, tokenizer, show_progress=False)
            preempted = read_counters(serve.http, {"preemptions": "tandem_preemptions_total"})["preemptions"]
        finally:
            await driver.close()
    finally:
        if serve.stop() != 0:
            print(f"[{policy}] tandem serve did not stop cleanly", file=sys.stderr)
    records = sorted(records, key=lambda r: r.start)
    run = predict(profile, scenario, records)
    simulated = run.requests
    out = {"preemptions": int(preempted), "predicted_preemptions": run.system.preemptions}
    for stream in STREAMS:
        mine = [r for r in records if r.stream == stream and not r.warmup]
        ok = [r for r in mine if r.ok]
        sim = summarize([s for s, r in zip(simulated, records) if r.stream == stream and not r.warmup],
                        profile.frontdoor, 1.0, 1.0)
        out[stream] = {"requests": len(mine), "failed": len(mine) - len(ok),
                       "ttft_s": dist([r.ttft for r in ok]), "e2e_s": dist([r.e2e for r in ok]),
                       "predicted": {"ttft_s": sim["ttft_s"], "e2e_s": sim["e2e_s"]}}
    return out


def predict(profile: Profile, scenario: Scenario, records: list) -> SimRun:
    """The simulated run, a request per record (sorted by send time, warm-up included: it loaded the
    machine too): a closed-loop stream's from its clients in that order, the others at their send times."""
    streams = {s.name: s for s in scenario.streams}
    specs = [RequestSpec(r.prompt_tokens or streams[r.stream].prompt_len, streams[r.stream].output_len,
                         None if streams[r.stream].concurrency else r.start, streams[r.stream].priority)
             for r in records]
    clients = sum(s.concurrency for s in scenario.streams if s.concurrency)
    return simulate(profile, ONE_P_ONE_D, specs, concurrency=clients or None)


def deployment_profile(path: str, max_num_seqs: int, kv_pool_bytes: int | None) -> Profile:
    """The profile at `path` with the served deployment's decode batch (and pool, when given)."""
    profile = load_profile(path)
    serving = {"decode_max_batch": max_num_seqs, **({"kv_pool_bytes": kv_pool_bytes} if kv_pool_bytes else {})}
    return profile.model_copy(update={"serving": profile.serving.model_copy(update=serving)})


def markdown(doc: dict) -> str:
    lines = ["# Priority scheduling vs first come, first served", "", f"Command: `{doc['command']}`", "",
             WORKLOAD.description + f"; 1P1D, `{' '.join(doc['serve_args'])}`. Wall-clock seconds on this "
             f"machine, both policies in one run. Load average (1 min) at the start {doc['load_start']:.1f}, at "
             f"the end {doc['load_end']:.1f}. Requests preempted: " + ", ".join(
                 f"{p} {doc['results'][p]['preemptions']} (predicted {doc['results'][p]['predicted_preemptions']})"
                 for p in POLICIES) + ".", "",
             f"Predicted: the planner's simulator with `{doc['profile']}`, the batch stream from its 8 closed-loop "
             f"clients, each interactive request at the time this run sent it.", "",
             "| stream | policy | requests | failed | TTFT p50 | TTFT p90 | E2E p50 | E2E p90 "
             "| predicted TTFT p50 / p90 | predicted E2E p50 / p90 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for stream in STREAMS:
        for policy in POLICIES:
            r = doc["results"][policy][stream]
            p = r["predicted"]
            lines.append(f"| {stream} | {policy} | {r['requests']} | {r['failed']} | {r['ttft_s']['p50']:.2f} | "
                         f"{r['ttft_s']['p90']:.2f} | {r['e2e_s']['p50']:.2f} | {r['e2e_s']['p90']:.2f} | "
                         f"{p['ttft_s']['p50']:.2f} / {p['ttft_s']['p90']:.2f} | "
                         f"{p['e2e_s']['p50']:.2f} / {p['e2e_s']['p90']:.2f} |")
    return "\n".join(lines) + "\n"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/smollm2-135m")
    ap.add_argument("--out", default=None, help="a folder for report.json and report.md")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="the decode batch (default 4: it binds)")
    ap.add_argument("--kv-pool-bytes", type=int, default=None, help="the decode pool (default: the profile's)")
    ap.add_argument("--profile", default="docs/planning/profiles/cpu-2core-avx2.json",
                    help="the hardware profile the predictions use (tandem profile)")
    args = ap.parse_args()
    profile = deployment_profile(args.profile, args.max_num_seqs, args.kv_pool_bytes)
    serve_args = ("--max-num-seqs", str(args.max_num_seqs),
                  *(("--kv-pool-bytes", str(args.kv_pool_bytes)) if args.kv_pool_bytes else ()))
    tokenizer = Tokenizer(os.path.join(args.engines, "prefill"))
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-priority-") as work:
        results = {p: await run_policy(args.engines, p, work, tokenizer, serve_args, profile) for p in POLICIES}
    doc = {"command": "python " + " ".join(sys.argv), "workload": WORKLOAD.to_dict(), "results": results,
           "serve_args": serve_args, "profile": args.profile,
           "load_start": load_start, "load_end": os.getloadavg()[0]}
    text = markdown(doc)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(doc, f, indent=2)
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    asyncio.run(main())
