"""The seed workload, its scaled variants, Poisson points, the suites' scenarios and the CPU meter."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from clients.bench.interference import CpuMeter
from clients.bench.suite import SUITES, settings_for
from clients.bench.bench_workload import (SCENARIOS, Scenario, Stream, poisson_scenario, requests_for, seed_scenario,
                                         warmup_scenario)
from clients.bench.drivers import make_driver


def test_the_seed_and_its_scaled_variants():
    seed = seed_scenario()
    (st,) = seed.streams
    assert seed.name == "seed" and (st.count, st.concurrency, st.prompt_len, st.output_len) == (64, 64, 512, 128)
    assert SCENARIOS["seed"].streams == seed.streams
    small = seed_scenario(0.25, 0.5)
    assert small.name == "seed-16x256-64" and small.streams[0].count == small.streams[0].concurrency == 16
    assert "0.25 of its clients, 0.5 of its lengths" in small.description
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        seed_scenario(2.0)


def test_poisson_points_last_about_their_duration():
    p = poisson_scenario(0.45, 256, 64, duration_s=100.0, min_requests=20)
    assert p.name == "rate-0.45" and p.streams[0].count == 45 and p.streams[0].rate == 0.45
    assert poisson_scenario(0.1, 8, 8, duration_s=10.0, min_requests=5).streams[0].count == 5
    with pytest.raises(ValueError, match="rate > 0"):
        poisson_scenario(0.0, 8, 8, 10.0)


def test_no_prompt_of_a_suite_is_a_prefix_of_another(default_engine):
    # a prefix cache would serve the repeated part: every scenario must draw its own prompts
    tok = default_engine.tokenizer
    suite = SUITES["equal-hardware-quick"]
    scenarios = suite.scenarios() + [warmup_scenario(2)]
    assert len({sc.seed for sc in scenarios}) == len(scenarios)
    heads = [tuple(tok.encode(r.prompt)[:16]) for sc in scenarios for r in requests_for(sc, tok)]
    assert len(set(heads)) == len(heads)


def test_settings_never_refuse_the_suites_own_load():
    suite = SUITES["equal-hardware"]
    s = settings_for(suite.scenarios(), "smollm2-135m", 1 << 30, 256)
    assert s.max_in_flight >= 64 and s.max_in_flight >= max(sc.streams[0].count for sc in suite.scenarios())
    assert s.max_queued_tokens >= s.max_in_flight * 512


def test_cpu_meter_tells_ours_from_others():
    # burn 0.6 s of CPU, say so, then wait (alive) until told to exit: a live worker, as in a suite
    burn = [sys.executable, "-c", "import sys, time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.6: pass\nprint('done', flush=True)\nsys.stdin.read()"]

    def run_child(meter_roots):
        proc = subprocess.Popen(burn, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        with CpuMeter(meter_roots(proc)) as meter:
            assert proc.stdout.readline() == "done\n"
        proc.communicate("")
        return meter.result

    others = run_child(lambda proc: [])  # the child is in no tree of the meter's
    assert others["others_cores"] * others["wall_s"] >= 0.5
    ours = run_child(lambda proc: [os.getpid()])  # the child of this process is ours
    assert ours["ours_cores"] * ours["wall_s"] >= 0.5
    with CpuMeter([2 ** 22 + 1]) as none_alive:  # above Linux's largest pid: a root with nothing to count
        pass
    assert none_alive.result["ours_cores"] == 0.0


def test_a_streams_priority_reaches_its_requests_and_both_drivers_send_it(default_engine, served):
    scenario = Scenario("p", (Stream("urgent", 8, 2, count=2, interval=1.0, priority=-3),
                              Stream("plain", 8, 2, count=1, concurrency=1)), warmup=0)
    specs = requests_for(scenario, default_engine.tokenizer)
    assert [(s.stream, s.priority) for s in specs] == [("urgent", -3), ("urgent", -3), ("plain", 0)]

    async def send(protocol: str, url: str) -> list[str]:
        driver = make_driver(protocol, url)
        try:
            return [(await driver.send(spec, 0.0)).error for spec in (specs[0], specs[2])]
        finally:
            await driver.close()

    for protocol, url in (("grpc", served.grpc), ("openai", served.http)):  # a first-come, first-served server
        urgent, plain = asyncio.run(send(protocol, url))
        assert "first come, first served" in urgent and plain is None, (protocol, urgent, plain)
