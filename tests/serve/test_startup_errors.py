"""Start-up failures end in one clear line and a non-zero exit, never a traceback: a port another
process holds (really held, by a listening socket here), a worker's Triton that will not start, keys
missing beyond loopback, the secret about to cross the network in the clear."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from control.channel import WorkerChannel
from ops.triton_process import free_port
from tandem.status import Unavailable
from tandem.wire import Stats
from tests.conftest import leak_check, leak_snapshot

TANDEM = [sys.executable, "-m", "cli.main"]


@pytest.fixture
def held_port():
    """A port some other process is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def run(*args: str, env: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    keep = ("TANDEM_CACHE", "TANDEM_TEST_SESSION")  # none of the options' variables, nor keys or the secret
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") or k in keep}
    proc = subprocess.run(TANDEM + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**clean, **(env or {})})
    return proc.returncode, proc.stderr


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_a_max_model_len_beyond_the_models_context_is_one_line(built_engines):
    code, err = run("serve", "--model", str(built_engines), "--http-port", str(free_port()),
                    "--grpc-port", str(free_port()), env={"TANDEM_MAX_MODEL_LEN": "9000"})
    line = one_error_line(err)
    assert code != 0 and "limits.max_model_len 9000" in line and "context of 8192" in line, line


def test_a_generation_config_that_cannot_be_read_is_one_line(built_engines, tmp_path):
    code, err = run("serve", "--model", str(built_engines), "--http-port", str(free_port()),
                    "--grpc-port", str(free_port()), "--generation-config", str(tmp_path / "missing"))
    line = one_error_line(err)
    assert code != 0 and "generation config" in line and "missing" in line, line
    code, err = run("serve", "--model", str(built_engines), "--override-generation-config", "[1]")
    line = one_error_line(err)
    assert code != 0 and "--override-generation-config" in line and "a JSON object is needed" in line, line
    code, err = run("serve", "--model", str(built_engines), "--http-port", str(free_port()),
                    "--grpc-port", str(free_port()), "--override-generation-config", '{"temp": 0.5}')
    line = one_error_line(err)
    assert code != 0 and "unknown field(s) ['temp']" in line, line


@pytest.mark.parametrize("args, says", [
    (["--allowed-origins", '"https://chat.example.com"'], "a JSON list of strings is needed"),
    (["--allowed-origins", '["chat.example.com/app"]'], "front_door.cors.allowed_origins"),
    (["--allowed-headers", '["X Debug"]'], "front_door.cors.allowed_headers"),
])
def test_cors_settings_that_cannot_be_served_are_one_line(built_engines, args, says):
    code, err = run("serve", "--model", str(built_engines), *args)
    line = one_error_line(err)
    assert code != 0 and says in line, line


def test_serve_names_the_port_in_use_by_flag_and_by_environment(built_engines, held_port):
    code, err = run("serve", "--model", str(built_engines), "--http-port", str(held_port),
                    "--grpc-port", str(free_port()))
    line = one_error_line(err)
    assert code != 0 and f"127.0.0.1:{held_port}" in line and "in use" in line and "HTTP" in line
    code, err = run("serve", "--model", str(built_engines), "--http-port", str(free_port()),
                    env={"TANDEM_GRPC_PORT": str(held_port)})
    line = one_error_line(err)
    assert code != 0 and f"127.0.0.1:{held_port}" in line and "gRPC" in line
    code, err = run("serve", "--model", str(built_engines), "--port", str(held_port),  # vLLM's name for it
                    "--grpc-port", str(free_port()))
    line = one_error_line(err)
    assert code != 0 and f"127.0.0.1:{held_port}" in line and "HTTP" in line


def test_serve_beyond_loopback_needs_keys_or_says_so(built_engines, tmp_path):
    ports = ["--http-port", str(free_port()), "--grpc-port", str(free_port())]
    code, err = run("serve", "--model", str(built_engines), "--host", "0.0.0.0", *ports)
    line = one_error_line(err)
    assert code != 0 and "--no-api-key" in line and "TANDEM_API_KEY" in line
    code, err = run("serve", "--model", str(built_engines), "--host", "0.0.0.0", *ports,
                    env={"TANDEM_API_KEY": "short"})
    assert code != 0 and "at least 8 characters" in one_error_line(err)
    code, err = run("serve", "--model", str(built_engines), *ports, "--no-api-key",
                    env={"TANDEM_API_KEY": "a-long-enough-key"})
    assert code != 0 and "choose one" in one_error_line(err)


def test_per_key_cache_isolation_and_limits_need_keys(built_engines, tmp_path):
    ports = ["--http-port", str(free_port()), "--grpc-port", str(free_port())]
    code, err = run("serve", "--model", str(built_engines), "--prefix-cache-per-api-key", *ports)
    line = one_error_line(err)
    assert code != 0 and "per_api_key" in line and "no keys are configured" in line and "TANDEM_API_KEY" in line
    code, err = run("serve", "--model", str(built_engines), *ports, env={"TANDEM_PREFIX_CACHE_PER_API_KEY": "1",
                                                                        "TANDEM_NO_API_KEY": "1"})
    assert code != 0 and "per_api_key" in one_error_line(err)
    cfg = tmp_path / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"limits": {"max_in_flight_per_key": 4}}))
    code, err = run("serve", "--model", str(built_engines), "--config", str(cfg), *ports)
    line = one_error_line(err)
    assert code != 0 and "max_in_flight_per_key" in line and "no API keys are configured" in line


def test_serve_refuses_to_send_the_secret_in_the_clear(built_engines, tmp_path):
    cfg = tmp_path / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"decode": {"count": 0, "urls": ["10.255.255.1:8001"]}}))
    code, err = run("serve", "--model", str(built_engines), "--config", str(cfg), "--http-port", str(free_port()),
                    "--grpc-port", str(free_port()), env={"TANDEM_SECRET": "a-deployment-secret-0123456789"})
    line = one_error_line(err)
    assert code != 0 and "10.255.255.1:8001" in line and "in the clear" in line and "worker_tls" in line


def test_the_channel_itself_never_sends_the_secret_off_loopback_without_tls():
    async def main():
        auth = (("tandem_secret", "a-deployment-secret-0123456789"),)
        channel = WorkerChannel("10.255.255.1:8001", "decode", auth=auth)
        try:
            with pytest.raises(Unavailable, match="in the clear"):
                await channel.call(Stats(), timeout=5)
            assert channel._stream is None  # no stream was ever opened
        finally:
            await channel.close()

    asyncio.run(main())


def test_worker_names_its_port_in_use(built_engines, held_port):
    code, err = run("worker", "--role", "prefill", "--engines", str(built_engines), "--grpc-port", str(held_port),
                    "--http-port", str(free_port()), "--metrics-port", str(free_port()))
    line = one_error_line(err)
    assert code != 0 and f"127.0.0.1:{held_port}" in line and "gRPC" in line


@pytest.fixture
def broken_engines(built_engines, tmp_path):
    """The session's engines with the prefill weights replaced by garbage: the prefill model cannot load."""
    broken = tmp_path / "engines"
    for role in ("prefill", "decode"):
        (broken / role).mkdir(parents=True)
        for name in os.listdir(built_engines / role):
            if not (role == "prefill" and name == "model.safetensors"):
                os.link(built_engines / role / name, broken / role / name)
    (broken / "prefill" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    return broken


def test_a_triton_that_will_not_start_ends_the_worker_in_one_line(broken_engines, tmp_path):
    work = tmp_path / "work"
    code, err = run("worker", "--role", "prefill", "--engines", str(broken_engines), "--grpc-port", str(free_port()),
                    "--http-port", str(free_port()), "--metrics-port", str(free_port()), "--workdir", str(work),
                    "--log-file")
    line = one_error_line(err)
    assert code != 0 and "prefill exited with" in line and str(work) in line and "manifest digest" in line
    shutil.rmtree(work, ignore_errors=True)


def test_a_triton_that_will_not_start_ends_serve_in_one_line(broken_engines, tmp_path):
    before = leak_snapshot()
    code, err = run("serve", "--model", str(broken_engines), "--http-port", str(free_port()),
                    "--grpc-port", str(free_port()), "--workdir", str(tmp_path / "work"), timeout=600)
    line = one_error_line(err)
    assert code != 0 and "prefill-0 exited with" in line and "manifest digest" in line
    assert leak_check(before) == []  # the decode worker that did start is stopped again
