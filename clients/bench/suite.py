"""The equal-hardware suite: every layout of the same cores, serving the seed bursts and a Poisson
rate sweep, one `tandem serve` after another (`tandem bench compare --suite equal-hardware`).

For each layout: a deployment file (limits that do not refuse the suite's own load), `tandem serve
--config` confined to the suite's cores, the pinning checked in workers.json, a warm-up, then every
scenario of the suite; the records of each are kept for the report (equal_report.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
from dataclasses import dataclass

from clients.bench.drivers import make_driver
from clients.bench.interference import CpuMeter
from clients.bench.bench_layouts import ServeSettings, check_pinning, cores, worker_counts, write_deployment
from clients.bench.runner import run_scenario
from clients.bench.stats import RequestRecord
from clients.bench.bench_workload import Scenario, poisson_scenario, seed_scenario, warmup_scenario
from ops.serve_process import ServeProcess
from planner.sim.sim_layouts import Layout


@dataclass(frozen=True)
class Sweep:
    """Poisson rates: given (`rates`), or `around` the capacity the planner predicts for the layouts on the
    run's profile (fractions of it; equal_report.bracket turns them into rates before anything runs)."""
    prompt_len: int
    output_len: int
    rates: tuple[float, ...]  # requests/s
    duration_s: float  # of arrivals per rate
    min_requests: int
    around: tuple[float, ...] = ()


@dataclass(frozen=True)
class Suite:
    name: str
    seeds: tuple[Scenario, ...]  # bursts (each client one request)
    sweep: Sweep
    slo_ttft_s: float
    slo_tpot_s: float
    target: float = 0.9

    def scenarios(self) -> list[Scenario]:
        """The seeds, then one Poisson scenario per rate; each with its own prompt seed, so no prompt is a
        prefix of another one (a prefix cache would serve it)."""
        s = self.sweep
        seeds = [dataclasses.replace(sc, seed=1 + i) for i, sc in enumerate(self.seeds)]
        return seeds + [poisson_scenario(r, s.prompt_len, s.output_len, s.duration_s, s.min_requests, seed=100 + i)
                        for i, r in enumerate(s.rates)]


# The sweep's lengths are the scaled seed's; the SLO is the one of docs/planning (2 CPU cores:
# TTFT <= 3 s, TPOT <= 300 ms), fixed before any of these runs; the rates bracket the 90% crossing the
# planner predicts on the run's own profile (the mean over the layouts): below, at and above it. (Fixed
# rates went stale: 0.3-0.6 req/s bracketed it on 2026-12-01; the AVX2 kernels put it past 0.6.)
SUITES = {
    "equal-hardware": Suite(
        "equal-hardware", (seed_scenario(), seed_scenario(0.25, 0.5)),
        Sweep(256, 64, (), duration_s=60.0, min_requests=20, around=(0.7, 1.0, 1.3)), slo_ttft_s=3.0,
        slo_tpot_s=0.3),
    # the same machinery at a tiny scale, for trying it out (a few minutes on 2 cores); its numbers mean little
    "equal-hardware-quick": Suite(
        "equal-hardware-quick", (seed_scenario(0.125, 0.25),),
        Sweep(128, 32, (0.4, 0.8, 1.2), duration_s=15.0, min_requests=6), slo_ttft_s=3.0, slo_tpot_s=0.3),
}


def settings_for(scenarios: list[Scenario], model: str, kv_pool_bytes: int, chunk_tokens: int) -> ServeSettings:
    """Deployment settings under which these scenarios are never refused: every request of the largest
    one may be open at once (an overloaded open loop queues them all), all of their prompts queued."""
    open_max = max(sum(st.count for st in sc.streams) for sc in scenarios) + 8  # + the warm-up's stragglers
    longest = max(st.prompt_len for sc in scenarios for st in sc.streams)
    return ServeSettings(model=model, kv_pool_bytes=kv_pool_bytes, chunk_tokens=chunk_tokens,
                         max_in_flight=open_max, max_queued_tokens=open_max * longest)


def slug(layout: Layout) -> str:
    return layout.name.replace(" ", "-")


def run_layout(scenarios: list[Scenario], layout: Layout, cpus: list[int], settings: ServeSettings, protocol: str,
               tokenizer, workdir: str, log=print) -> dict:
    """Serve `layout` on `cpus`, warm it up and run `scenarios` one after another;
    {"pinning": {worker: cores}, "deployment": its file, "runs": {scenario name: records},
     "cpu": {scenario name: CpuMeter result (what other processes took meanwhile)}}."""
    folder = os.path.join(workdir, slug(layout))
    os.makedirs(folder, exist_ok=True)
    config = write_deployment(os.path.join(folder, "deployment.yaml"), layout, settings)
    log(f"[{layout.name}] starting tandem serve on cores {cpus} (logs in {folder}) ...")
    with cores(cpus):
        serve = ServeProcess(folder, ("--config", config)).start()
    try:
        pinning = check_pinning(serve.workers(), layout, cpus)
        log(f"[{layout.name}] pinning {pinning}")
        workers = sum(worker_counts(layout).values())
        asyncio.run(_one(warmup_scenario(workers), protocol, serve, tokenizer))
        runs: dict[str, list[RequestRecord]] = {}
        others: dict[str, dict] = {}
        for scenario in scenarios:
            log(f"[{layout.name}] {scenario.name}: {scenario.description}")
            with CpuMeter([os.getpid(), serve.proc.pid]) as meter:
                runs[scenario.name] = asyncio.run(_one(scenario, protocol, serve, tokenizer))
            others[scenario.name] = meter.result
            log(f"[{layout.name}] {scenario.name}: other processes used {meter.result['others_cores']:.2f} cores")
    finally:
        code = serve.stop()
        if code != 0:
            log(f"[{layout.name}] tandem serve exited with {code}")
    return {"pinning": pinning, "deployment": config, "runs": runs, "cpu": others}


async def _one(scenario: Scenario, protocol: str, serve: ServeProcess, tokenizer) -> list[RequestRecord]:
    driver = make_driver(protocol, serve.grpc if protocol == "grpc" else serve.http)
    try:
        return await run_scenario(scenario, driver, tokenizer)
    finally:
        await driver.close()


def kv_need_bytes(suite: Suite, kv_bytes_per_token: int) -> int:
    """KV bytes of the largest seed burst if one worker held all of it (prompt + every output token)."""
    return max(math.prod((st.count, st.prompt_len + st.output_len, kv_bytes_per_token))
               for sc in suite.seeds for st in sc.streams)
