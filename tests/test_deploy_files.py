"""Compose stacks and images (deploy/): valid files, one service per role, the front door on the loopback
only, health checks from Triton's readiness and the orchestrator's /health, networks inside
198.18.0.0/15, the secret as a file, and deployment files the orchestrator itself accepts."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess

import pytest
import yaml

from ops.deployment import WorkerPool, load_deployment

# keys double as test ids: not "gpu", which tests/conftest.py skips on CPU machines
STACKS = {"cpu": "deploy/docker-compose.cpu.yml", "nvidia": "deploy/docker-compose.gpu.yml"}
ENV = {"TRTLLM_IMAGE": "example/trtllm:latest", "TRITON_IMAGE": "example/tritonserver:latest-trtllm-python-py3",
       "TANDEM_COMPOSE_SECRET": "/nonexistent/tandem.secret", "TANDEM_COMPOSE_TLS": "/nonexistent/tls",
       "PATH": "/usr/bin:/bin"}
BENCHMARK_NET = ipaddress.ip_network("198.18.0.0/15")


def stack(name: str) -> dict:
    with open(STACKS[name]) as f:
        return yaml.safe_load(f)


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("name", STACKS)
def test_one_service_per_role_and_only_the_front_door_published_on_loopback(name):
    services = stack(name)["services"]
    assert set(services) == {"engines", "orchestrator", "prefill", "decode"}
    assert [s for s, v in services.items() if v.get("ports")] == ["orchestrator"]
    assert sorted(services["orchestrator"]["ports"]) == ["127.0.0.1:${TANDEM_GRPC_PORT:-8001}:8001",
                                                         "127.0.0.1:${TANDEM_HTTP_PORT:-8000}:8000"]
    for svc in (services[role] for role in ("orchestrator", "prefill", "decode")):
        assert svc["restart"] in ("unless-stopped", "on-failure")
    assert services["engines"]["restart"] == "no"  # one-shot: a finished build is not started again


@pytest.mark.parametrize("name", STACKS)
def test_engines_are_built_once_from_the_mounted_model_into_a_volume_the_roles_read(name):
    doc = stack(name)
    services = doc["services"]
    build = services["engines"]
    cmd = build["command"]
    assert cmd[:2] == ["tandem", "build"] and flag(cmd, "--model") == "${TANDEM_MODEL:-smollm2-135m}"
    assert "--force" in cmd and flag(cmd, "--dtype").startswith("${TANDEM_DTYPE:-")
    assert build["network_mode"] == "none" and "secrets" not in build  # it needs neither
    assert build["volumes"] == ["${TANDEM_MODEL_DIR:-model}:/models/own:ro", "engines:/opt/tandem/engines"]
    assert set(doc["volumes"]) == {"engines", "model"}
    served = "engines/" + flag(cmd, "--out").removeprefix("engines/")  # relative to the image's /opt/tandem
    for role in ("prefill", "decode"):
        svc = services[role]
        assert flag(svc["command"], "--engines") == served
        assert svc["depends_on"]["engines"] == {"condition": "service_completed_successfully"}
    for role in ("prefill", "decode", "orchestrator"):
        assert "engines:/opt/tandem/engines:ro" in services[role]["volumes"]
    assert load_deployment("deploy/compose/deployment.yaml", {}).engines == served


@pytest.mark.parametrize("name", STACKS)
def test_workers_follow_the_worker_contract_with_triton_readiness_checks(name):
    services = stack(name)["services"]
    for role in ("prefill", "decode"):
        svc = services[role]
        cmd = svc["command"]
        assert cmd[:2] == ["tandem", "worker"] and flag(cmd, "--role") == role and flag(cmd, "--transport") == "nixl"
        assert flag(cmd, "--host") == "0.0.0.0"  # inside the stack's network; nothing of it is published
        check = " ".join(svc["healthcheck"]["test"])
        assert f"127.0.0.1:{flag(cmd, '--http-port')}/v2/health/ready" in check
        env = svc["environment"]
        assert env["UCX_NET_DEVICES"] == "eth0" and "sm" not in env["UCX_TLS"].split(",")
        low, high = map(int, env["UCX_TCP_PORT_RANGE"].split("-"))
        assert 1024 < low <= high < 65536
        if name == "nvidia":  # engines on their reserved GPU, CUDA IPC between the two containers' GPUs
            assert flag(cmd, "--device") == "cuda" and svc["ipc"] == "host"
            (gpu,) = svc["deploy"]["resources"]["reservations"]["devices"]
            assert gpu["capabilities"] == ["gpu"] and len(gpu["device_ids"]) == 1
            assert {"cuda_copy", "cuda_ipc"} <= set(env["UCX_TLS"].split(","))
        else:
            assert "--device" not in cmd
    orch = services["orchestrator"]
    assert "127.0.0.1:8000/health" in " ".join(orch["healthcheck"]["test"])
    assert all(orch["depends_on"][r]["condition"] == "service_healthy" for r in ("prefill", "decode"))


@pytest.mark.parametrize("name", STACKS)
def test_secret_is_a_file_given_at_start_and_network_stays_in_the_benchmark_range(name):
    doc = stack(name)
    assert doc["secrets"]["tandem_secret"]["file"].startswith("${TANDEM_COMPOSE_SECRET:?")
    for svc in (doc["services"][role] for role in ("orchestrator", "prefill", "decode")):
        assert svc["secrets"] == ["tandem_secret"]
        env = svc.get("environment", {})
        assert env["TANDEM_SECRET_FILE"] == "/run/secrets/tandem_secret" and "TANDEM_SECRET" not in env
    for net in doc["networks"].values():
        for pool in net["ipam"]["config"]:
            assert ipaddress.ip_network(pool["subnet"]).subnet_of(BENCHMARK_NET)


def test_compose_deployment_file_is_accepted_and_names_the_stack_services():
    dep = load_deployment("deploy/compose/deployment.yaml", {})
    services = stack("cpu")["services"]
    for role in ("prefill", "decode"):
        pool = getattr(dep, role)
        assert pool.count == 0 and len(pool.urls) == 1
        host, port = pool.urls[0].split(":")
        assert host in services and port == flag(services[host]["command"], "--grpc-port")
    assert dep.transport == "nixl" and dep.front_door.host == "0.0.0.0"
    mount = services["orchestrator"]["volumes"][0].split(":")
    assert os.path.normpath(os.path.join("deploy", mount[0])) == "deploy/compose/deployment.yaml"
    assert mount[1] == flag(services["orchestrator"]["command"], "--config")


@pytest.mark.skipif("dns" not in WorkerPool.model_fields, reason="the deployment file has no DNS worker discovery yet")
def test_kubernetes_orchestrator_config_is_accepted():
    with open("deploy/kubernetes/base/orchestrator.yaml") as f:
        cm = next(d for d in yaml.safe_load_all(f) if d["kind"] == "ConfigMap")
    data = yaml.safe_load(cm["data"]["deployment.yaml"])
    from ops.deployment import Deployment

    assert Deployment(**data).prefill.count == 0


def test_trtllm_alternative_uses_the_generated_configs_and_its_service_names():
    with open("deploy/docker-compose.trtllm.yml") as f:
        doc = yaml.safe_load(f)
    assert set(doc["services"]) == {"prefill", "decode", "frontend"}
    assert all(p.startswith("127.0.0.1:") for p in doc["services"]["frontend"]["ports"])
    assert "disagg_config.compose.yaml" in " ".join(doc["services"]["frontend"]["command"])
    from builder.trtllm_build import CTX_PORT, GEN_PORT

    ports = {s: flag(doc["services"][s]["command"], "--port") for s in ("prefill", "decode")}
    assert ports == {"prefill": str(CTX_PORT), "decode": str(GEN_PORT)}


def test_images_build_from_a_configurable_base_and_pin_torch():
    with open("deploy/Dockerfile.cpu") as f:
        cpu = f.read()
    assert "ARG BASE=python:3.11-slim\nFROM ${BASE} AS runtime" in cpu and '"torch==2.13.0"' in cpu
    # the CPU kernels are compiled in a stage of their own: the image gets them, not the compiler
    stages = cpu.split("\nFROM ")
    assert stages[-1].startswith("runtime\n") and "COPY --from=kernels" in stages[-1] and "g++" not in stages[-1]
    assert stages[-2].startswith("runtime AS kernels") and "engine.cpu_kernels.build" in stages[-2]
    with open("deploy/Dockerfile.gpu") as f:
        gpu = f.read()
    assert "ARG TRITON_IMAGE\nFROM ${TRITON_IMAGE}" in gpu and "torch==" not in gpu  # keeps the image's CUDA torch
    with open(".dockerignore") as f:
        ignored = f.read().split()
    assert {".venv/", ".git/", "engines/"} <= set(ignored)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
@pytest.mark.parametrize("path", [*STACKS.values(), "deploy/docker-compose.trtllm.yml"])
def test_compose_config_validates(path):
    proc = subprocess.run(["docker-compose", "-f", path, "config", "-q"], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr
    # the stack refuses to start without a secret file, or without the workers' TLS folder
    for needed in ("TANDEM_COMPOSE_SECRET", "TANDEM_COMPOSE_TLS"):
        if needed in open(path).read():
            missing = {k: v for k, v in ENV.items() if k != needed}
            proc = subprocess.run(["docker-compose", "-f", path, "config", "-q"], capture_output=True, text=True,
                                  env=missing)
            assert proc.returncode != 0 and needed in proc.stderr
