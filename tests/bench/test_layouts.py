"""Equal-hardware layouts: names, deployment files the schema accepts, and the pinning check."""

from __future__ import annotations

import os

import pytest
import yaml

from clients.bench.bench_layouts import (LayoutError, ServeSettings, check_pinning, cores, deployment,
                                        equal_hardware_layouts, parse_layouts, write_deployment)
from ops.deployment import load_deployment
from planner.sim.sim_layouts import Layout

SETTINGS = ServeSettings(model="smollm2-135m", kv_pool_bytes=1 << 30, chunk_tokens=128, max_in_flight=80,
                         max_queued_tokens=80 * 512)


def test_every_layout_of_the_cores_and_nothing_else():
    assert [x.name for x in equal_hardware_layouts(2)] == ["1P1D", "colocated 2x1", "colocated 1x2", "chunked 2x1",
                                                           "chunked 1x2"]
    four = [x.name for x in equal_hardware_layouts(4)]
    assert four[:3] == ["1P3D", "2P2D", "3P1D"] and "colocated 1x4" in four and len(four) == 7
    assert all(x.devices == 4 for x in equal_hardware_layouts(4))
    assert [x.name for x in equal_hardware_layouts(1)] == ["colocated 1x1", "chunked 1x1"]
    assert [x.name for x in parse_layouts("chunked 1x2, 1P1D", 2)] == ["chunked 1x2", "1P1D"]
    with pytest.raises(LayoutError, match=r"unknown layout\(s\) \['2P1D'\] for 2 cores; allowed: 1P1D"):
        parse_layouts("2P1D", 2)


def test_deployment_files_are_what_tandem_serve_reads(tmp_path):
    path = write_deployment(str(tmp_path / "d.yaml"), Layout("chunked", 2), SETTINGS)
    dep = load_deployment(path, {})
    assert (dep.mode, dep.replicas, dep.chunk_tokens, dep.kv_pool_bytes) == ("chunked", 2, 128, 1 << 30)
    assert (dep.limits.max_in_flight, dep.limits.max_queued_tokens) == (80, 80 * 512)
    d = load_deployment(write_deployment(str(tmp_path / "p.yaml"), Layout("disaggregated", 1, 3), SETTINGS), {})
    assert (d.mode, d.prefill.count, d.decode.count) == ("disaggregated", 1, 3)
    assert "chunk_tokens" not in yaml.safe_load(open(tmp_path / "p.yaml"))
    bad = ServeSettings(**{**SETTINGS.__dict__, "max_in_flight": 0})
    with pytest.raises(ValueError, match="max_in_flight"):
        deployment(Layout("colocated", 2), bad)


def test_pinning_must_give_each_worker_its_own_share():
    one_each = {"prefill-0": {"cpus": [4]}, "decode-0": {"cpus": [5]}}
    assert check_pinning(one_each, Layout("disaggregated", 1, 1), [4, 5]) == {"prefill-0": [4], "decode-0": [5]}
    assert check_pinning({"generate-0": {"cpus": [5, 4]}}, Layout("colocated", 1, devices_per_worker=2), [4, 5]) \
        == {"generate-0": [4, 5]}
    with pytest.raises(LayoutError, match="not disjoint shares"):
        check_pinning({"generate-0": {"cpus": [4]}, "generate-1": {"cpus": [4]}}, Layout("colocated", 2), [4, 5])
    with pytest.raises(LayoutError, match="not disjoint shares"):  # one of the two cores left idle
        check_pinning({"generate-0": {"cpus": [4]}}, Layout("colocated", 1, devices_per_worker=2), [4, 5])
    with pytest.raises(LayoutError, match=r"expected \{'prefill-0': \[4\], 'decode-0': \[5\]\}"):
        check_pinning({"prefill-0": {"cpus": [5]}, "decode-0": {"cpus": [4]}}, Layout("disaggregated", 1, 1), [4, 5])
    with pytest.raises(LayoutError, match=r"workers \['generate-0'\] running, expected"):
        check_pinning({"generate-0": {"cpus": [4, 5]}}, Layout("disaggregated", 1, 1), [4, 5])


def test_cores_confines_children_and_restores_the_process():
    before = os.sched_getaffinity(0)
    mine = sorted(before)[:1]
    with cores(mine):
        assert os.sched_getaffinity(0) == set(mine)
    assert os.sched_getaffinity(0) == before
    with pytest.raises(LayoutError, match="not available"):
        with cores([max(before) + 1000]):
            pass
