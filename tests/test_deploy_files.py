"""Docker files: the compose stacks are valid and publish ports on the loopback only."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml


def test_cpu_stack_binds_loopback_and_has_room_for_the_kv_pool():
    doc = yaml.safe_load(open("deploy/docker-compose.cpu.yml"))
    svc = doc["services"]["tandem"]
    assert all(p.startswith("127.0.0.1:") for p in svc["ports"])
    assert svc["shm_size"] == "4gb" and svc["build"]["dockerfile"] == "deploy/Dockerfile.cpu"


def test_gpu_stack_uses_the_generated_trtllm_configs():
    doc = yaml.safe_load(open("deploy/docker-compose.gpu.yml"))
    assert set(doc["services"]) == {"prefill", "decode", "frontend"}
    assert all(p.startswith("127.0.0.1:") for p in doc["services"]["frontend"]["ports"])
    assert "disagg_config.compose.yaml" in " ".join(doc["services"]["frontend"]["command"])


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
@pytest.mark.parametrize("name", ["docker-compose.cpu.yml", "docker-compose.gpu.yml"])
def test_compose_config_validates(name):
    env = {"TRTLLM_IMAGE": "example/trtllm:latest", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["docker-compose", "-f", f"deploy/{name}", "config", "-q"], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr
