"""Run a scenario against one front door: closed-loop and open-loop streams side by side."""

from __future__ import annotations

import asyncio
import time

from tqdm import tqdm

from clients.bench.stats import RequestRecord
from clients.bench.bench_workload import RequestSpec, Scenario, requests_for


async def run_scenario(scenario: Scenario, driver, tokenizer, show_progress: bool = True) -> list[RequestRecord]:
    specs = requests_for(scenario, tokenizer)
    records: list[RequestRecord] = []
    bar = tqdm(total=len(specs), desc=scenario.name, unit="req", disable=not show_progress, leave=False)
    t_run = time.perf_counter()

    async def send(spec: RequestSpec) -> None:
        records.append(await driver.send(spec, t_run))
        bar.update(1)

    async def closed_loop(queue: list[RequestSpec]) -> None:
        while queue:
            await send(queue.pop(0))

    async def at(spec: RequestSpec) -> None:
        await asyncio.sleep(max(0.0, spec.arrival - (time.perf_counter() - t_run)))
        await send(spec)

    tasks = []
    for stream in scenario.streams:
        mine = [s for s in specs if s.stream == stream.name]
        if stream.concurrency:
            async def delayed(q=mine, delay=stream.start_after):
                await asyncio.sleep(delay)
                await closed_loop(q)
            tasks += [delayed() for _ in range(stream.concurrency)]
        else:
            tasks += [at(s) for s in mine]
    try:
        await asyncio.gather(*tasks)
    finally:
        bar.close()
    return sorted(records, key=lambda r: r.start)
