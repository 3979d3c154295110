"""One layout served for real on equal hardware: deployment file, pinning read back, records."""

from __future__ import annotations

import os

import pytest

from clients.bench.bench_layouts import ServeSettings
from clients.bench.suite import run_layout
from clients.bench.bench_workload import Scenario, Stream
from planner.sim.sim_layouts import Layout
from tests.conftest import leak_check, leak_snapshot


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to split")
def test_two_replicas_each_on_its_own_core(built_engines, default_engine, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    burst = Scenario("burst", (Stream("burst", 24, 4, count=4, concurrency=4),), warmup=0, seed=5)
    settings = ServeSettings(model=str(built_engines), kv_pool_bytes=64 << 20, chunk_tokens=64, max_in_flight=8,
                             max_queued_tokens=8 * 64)
    before = leak_snapshot()
    done = run_layout([burst], Layout("colocated", 2), cpus, settings, "grpc", default_engine.tokenizer,
                      str(tmp_path), log=lambda _m: None)
    assert leak_check(before) == []
    assert done["pinning"] == {"generate-0": [cpus[0]], "generate-1": [cpus[1]]}
    assert "replicas: 2" in open(done["deployment"]).read()
    records = done["runs"]["burst"]
    assert len(records) == 4 and all(r.ok and r.output_tokens == 4 and r.prompt_tokens > 0 for r in records)
