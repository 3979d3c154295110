"""Device choice end to end on a machine without CUDA: refusals at once, KIND_GPU repositories, GPU plans.

The refusals run the real `tandem` command in its own process; the repository is rendered from the
session's real engines. What a GPU does with all this is covered by the `gpu`-marked tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from builder.repo import RenderError, RepoOptions, render_repo
from cli.main import main
from ops.deployment import DeploymentError, load_deployment
from ops.gpu_plan import visible_devices, worker_env, worker_gpu
from ops.stack import local_gpus
from tandem.devices import DeviceError, resolve_device

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without CUDA")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tandem(*args: str, tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmp_path)))
    return proc, time.monotonic() - t


@pytest.mark.parametrize("args", [
    ("serve", "--device", "cuda", "--grpc-port", "0", "--http-port", "0"),
    ("worker", "--role", "decode", "--engines", "nowhere", "--device", "cuda"),
    ("build", "--device", "cuda", "--dry-run"),
], ids=["serve", "worker", "build"])
def test_cuda_without_cuda_is_refused_at_once_in_one_line(args, tmp_path):
    proc, took = run_tandem(*args, tmp_path=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "device cuda asked for" in lines[0] and "CUDA" in lines[0] and "--device cpu" in lines[0]
    print(f"{args[0]} refused in {took:.1f}s")  # the <30 s goal is reported, not asserted (no timed assertions)
    assert not os.listdir(tmp_path)  # nothing was started: no worker folder, no repository


@pytest.mark.parametrize("args, says", [
    (("serve", "--gpu-memory-utilization", "0.5", "--grpc-port", "0", "--http-port", "0"),
     "gpu_memory_utilization sizes KV pools on GPUs, but no local worker runs on one"),
    (("worker", "--role", "decode", "--engines", "nowhere", "--gpu-memory-utilization", "0.5"),
     "--gpu-memory-utilization sizes a KV pool on a GPU, but this worker runs on the CPU"),
    (("worker", "--role", "decode", "--engines", "nowhere", "--gpu-memory-utilization", "0.5", "--kv-pool-bytes",
      "100000000"), "give one of the two"),
], ids=["serve", "worker", "worker-both"])
def test_gpu_memory_utilization_without_a_gpu_is_refused_at_once_in_one_line(args, says, tmp_path):
    proc, _ = run_tandem(*args, tmp_path=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not os.listdir(tmp_path)  # nothing was started


def test_auto_is_the_cpu_here_and_cuda_with_gpus_is_refused():
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(DeviceError, match="device cuda asked for"):
        resolve_device("auto", [0])  # naming GPUs asks for CUDA
    with pytest.raises(DeviceError, match="gpus \\[1\\] were given for device cpu"):
        resolve_device("cpu", [1])
    with pytest.raises(DeviceError, match="unknown device 'tpu'; allowed: auto, cpu, cuda"):
        resolve_device("tpu")


def test_repo_device_cuda_renders_one_gpu_per_model(built_engines, tmp_path):
    out = tmp_path / "repo"
    r = CliRunner().invoke(main, ["repo", "--engines", str(built_engines), "--out", str(out), "--device", "cuda",
                                  "--gpu", "decode=1"])
    assert r.exit_code == 0, r.output
    configs = {m: (out / m / "config.pbtxt").read_text() for m in ("prefill", "decode", "generate")}
    assert "instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]" in configs["prefill"]
    assert "instance_group [ { kind: KIND_GPU count: 1 gpus: [ 1 ] } ]" in configs["decode"]
    assert 'key: "transports" value { string_value: "cuda_ipc" }' in configs["decode"]  # a pool in GPU memory
    assert all("KIND_CPU" not in c for c in configs.values())


def test_repo_on_the_cpu_keeps_kind_cpu_and_shm(built_engines, tmp_path):
    render_repo(str(built_engines), str(tmp_path / "repo"), RepoOptions())
    decode = (tmp_path / "repo" / "decode" / "config.pbtxt").read_text()
    assert "instance_group [ { kind: KIND_CPU count: 1 } ]" in decode
    assert 'string_value: "shm" }' in decode


def test_a_transport_that_cannot_reach_the_pool_is_refused(built_engines, tmp_path):
    with pytest.raises(RenderError, match="transport shm cannot reach a decode pool in GPU memory; use cuda_ipc"):
        render_repo(str(built_engines), str(tmp_path / "a"), RepoOptions(transport="shm", gpus=(("decode", 0),)))
    with pytest.raises(RenderError, match="transport cuda_ipc cannot reach a decode pool in host memory; use shm"):
        render_repo(str(built_engines), str(tmp_path / "b"), RepoOptions(transport="cuda_ipc"))
    r = CliRunner().invoke(main, ["repo", "--engines", str(built_engines), "--out", str(tmp_path / "c"),
                                  "--device", "cpu", "--gpu", "decode=0"])
    assert r.exit_code != 0 and "MODEL=INDEX" in r.output


def test_deployment_devices_per_role():
    dep = load_deployment(None, {"device": "cpu", "prefill": {"count": 2, "device": "cuda", "gpus": [0, 1]}})
    assert dep.role_device("prefill") == "cuda" and dep.role_device("decode") == "cpu"
    assert dep.role_device("generate") == "cpu"
    with pytest.raises(DeploymentError, match="decode.gpus \\[0\\] given for device cpu"):
        load_deployment(None, {"device": "cpu", "decode": {"gpus": [0]}})
    with pytest.raises(DeploymentError, match="decode.gpus.0: Input should be greater than or equal to 0"):
        load_deployment(None, {"decode": {"gpus": [-1]}})
    with pytest.raises(DeploymentError, match="device cuda asked for"):
        local_gpus(dep)  # its prefill workers want CUDA, which this machine lacks
    assert local_gpus(load_deployment(None, {})) == {}  # auto: every worker on the CPU here


def test_workers_take_their_gpus_in_turn_and_see_their_own_first():
    gpus = {"prefill": (0, 1), "decode": (1,)}
    assert [worker_gpu(gpus, "prefill", i) for i in range(3)] == [0, 1, 0]
    assert worker_gpu(gpus, "decode", 5) == 1 and worker_gpu(gpus, "generate", 0) is None
    # decode sees its GPU alone; a prefill worker also sees the decode GPUs (cuda_ipc opens pools there)
    assert worker_env(gpus, "decode", 0) == {"CUDA_VISIBLE_DEVICES": visible_devices(1, (), parent="")} == \
        {"CUDA_VISIBLE_DEVICES": "1"}
    assert visible_devices(0, (1,), parent="") == "0,1"
    assert visible_devices(1, (0, 1), parent="") == "1,0"
    # indices are positions in the launching process's own CUDA_VISIBLE_DEVICES
    assert visible_devices(1, (0,), parent="2,3") == "3,2"
    assert visible_devices(0, (), parent="GPU-aaaa,GPU-bbbb") == "GPU-aaaa"
    assert worker_env({}, "prefill", 0) == {}  # a CPU worker's environment is left alone


def test_workers_sharing_a_gpu_must_fit_in_its_memory(built_engines):
    from ops.gpu_plan import PROCESS_OVERHEAD_BYTES, check_fits, planned_bytes, role_bytes

    dep = load_deployment(None, {"kv_pool_bytes": 1 << 30, "prefix_cache": {"prefill_pool_bytes": 256 << 20}})
    weights, pools = role_bytes(dep, str(built_engines))
    assert weights["prefill"] > 100 << 20 and pools == {"prefill": 256 << 20, "decode": 1 << 30, "generate": 1 << 30}
    one_gpu = planned_bytes({"prefill": (0,), "decode": (0,)}, {"prefill": 1, "decode": 1}, weights, pools)
    assert one_gpu == {0: weights["prefill"] + weights["decode"] + (256 << 20) + (1 << 30) + 2 * PROCESS_OVERHEAD_BYTES}
    check_fits(one_gpu, {0: 16 << 30})  # 1P1D of the default model fits a 16 GiB GPU
    with pytest.raises(DeviceError, match=f"GPU 0 would hold {one_gpu[0] / 2**30:.1f} GiB for its workers .* but has "
                                          f"2.0 GiB; lower kv_pool_bytes"):
        check_fits(one_gpu, {0: 2 << 30})
    two = planned_bytes({"prefill": (0,), "decode": (1,)}, {"prefill": 1, "decode": 2}, weights, pools)
    assert set(two) == {0, 1} and two[1] == 2 * (weights["decode"] + (1 << 30) + PROCESS_OVERHEAD_BYTES)
