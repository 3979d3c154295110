"""The deployment file is validated once at start: unknown keys, bad values, engines that cannot pair."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ops.deployment import DeploymentError, load_deployment
from ops.stack import ensure_engines


def test_example_file_and_overrides(tmp_path):
    dep = load_deployment("deploy/deployment.yaml", {"decode.count": 2, "front_door.http_port": 9000})
    assert dep.mode == "disaggregated" and dep.prefill.count == 1 and dep.decode.count == 2
    assert dep.front_door.http_port == 9000 and dep.front_door.grpc_port == 8001
    assert dep.front_door.host == "127.0.0.1"
    assert dep.device == "auto" and dep.transport is None  # the one-host transport for wherever decode runs


@pytest.mark.parametrize("text, message", [
    ("modle: x\n", "modle: Extra inputs are not permitted"),
    ("front_door: {grpc_prot: 1}\n", "front_door.grpc_prot: Extra inputs are not permitted"),
    ("mode: turbo\n", "mode: Input should be 'disaggregated', 'colocated' or 'chunked'"),
    ("prefill: {count: 0}\n", "needs at least one prefill worker"),
    ("transport: tcp\n", "transport: Input should be 'shm', 'cuda_ipc', 'nixl' or 'auto'"),
    ("dtype: fp8\n", "dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"),
    ("- a list\n", "must be a mapping"),
    ("key: [unclosed\n", "cannot read deployment file"),
])
def test_bad_files_are_refused_naming_the_field(tmp_path, text, message):
    path = tmp_path / "dep.yaml"
    path.write_text(text)
    with pytest.raises(DeploymentError) as e:
        load_deployment(str(path), {})
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    ({"transport": "shm", "prefill.device": "cuda"}, "prefill workers on cuda keep theirs on the GPU; use "
                                                     "transport cuda_ipc, nixl or auto"),
    ({"transport": "cuda_ipc", "prefill.device": "cpu"}, "reads a prefill pool on a GPU into a decode pool on a GPU"),
    ({"transport": "cuda_ipc", "device": "cuda", "decode.device": "cpu"}, "set prefill.device and decode.device"),
    ({"prefill.device": "cuda", "decode.device": "cpu"}, "needs decode workers on cuda too; set decode.device: "
                                                         "cuda, or transport nixl"),
])
def test_pull_refuses_only_the_transports_that_cannot_read_the_prefill_pool(overrides, message):
    with pytest.raises(DeploymentError, match=message):
        load_deployment(None, {"handoff.mode": "pull", **overrides})


@pytest.mark.parametrize("overrides", [
    {"transport": "nixl"}, {"transport": "nixl", "device": "cuda"}, {"transport": "auto"}, {"transport": "shm"},
    {"transport": "cuda_ipc", "device": "cuda"}, {"prefill.device": "cuda", "decode.device": "cpu", "transport": "nixl"},
])
def test_pull_reads_over_nixl_anywhere_and_cuda_ipc_between_gpus(overrides):
    dep = load_deployment(None, {"handoff.mode": "pull", **overrides})
    assert dep.handoff.mode == "pull" and dep.transport == overrides["transport"]


def test_engines_that_cannot_pair_are_refused_at_start(built_engines, tmp_path):
    eng = tmp_path / "eng"
    shutil.copytree(built_engines / "prefill", eng / "prefill")
    shutil.copytree(built_engines / "decode", eng / "decode")
    m = json.loads((eng / "decode" / "manifest.json").read_text())
    m["kv_layout"]["tokens_per_page"] = 32
    (eng / "decode" / "manifest.json").write_text(json.dumps(m))
    dep = load_deployment(None, {"engines": str(eng)})
    with pytest.raises(DeploymentError, match="'tokens_per_page': prefill has 16, decode has 32"):
        ensure_engines(dep, log=lambda *_: None)


def test_serve_refuses_a_bad_deployment_without_starting_anything(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "dep.yaml"
    path.write_text("mode: disaggregated\ndecode: {count: 0}\n")
    proc = subprocess.run([sys.executable, "-m", "cli.main", "serve", "--config", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "needs at least one decode worker" in proc.stderr


def test_serve_builds_engines_in_the_dtype_asked_for(tmp_path, monkeypatch):
    """`tandem serve --dtype bfloat16` (deployment `dtype:`) reaches the build: both role engines hold bf16."""
    from tandem.manifest import read_manifest

    monkeypatch.chdir(tmp_path)
    dep = load_deployment(None, {"dtype": "bfloat16"})
    folder = ensure_engines(dep, log=lambda *_: None)
    assert [read_manifest(os.path.join(folder, r)).dtype for r in ("prefill", "decode")] == ["bfloat16"] * 2
