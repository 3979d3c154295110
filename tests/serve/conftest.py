"""A running `tandem serve` (the real command, in its own process) for front-door tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import pytest

from orchestrator.triton_process import free_port
from tests.conftest import leak_check


@dataclass
class Served:
    grpc: str
    http: str
    workdir: str
    proc: subprocess.Popen

    def workers(self) -> dict:
        with open(os.path.join(self.workdir, "workers.json")) as f:
            return json.load(f)


def start_serve(engines, workdir, *extra) -> Served:
    gp, hp = free_port(), free_port()
    log = open(os.path.join(workdir, "serve.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--model", str(engines), "--grpc-port",
                             str(gp), "--http-port", str(hp), "--kv-pool-bytes", str(256 << 20), "--workdir",
                             str(workdir), *extra], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited: {open(log.name).read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{hp}/health", timeout=2) as r:
                if r.status == 200:
                    return Served(f"127.0.0.1:{gp}", f"http://127.0.0.1:{hp}", str(workdir), proc)
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("tandem serve did not become healthy")


def stop_serve(s: Served) -> None:
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(timeout=120)
    assert s.proc.returncode == 0, open(os.path.join(s.workdir, "serve.log")).read()[-3000:]
    assert leak_check() == []


@pytest.fixture(scope="session")
def served(built_engines, tmp_path_factory):
    s = start_serve(built_engines, tmp_path_factory.mktemp("serve-1p1d"))
    yield s
    stop_serve(s)
