"""`tandem serve` as a child process: start it on free ports, wait until healthy, stop it cleanly.

Used by `tandem bench compare` (one deployment per mode), `tandem batch` (one it serves itself), the benchmark
scripts and the tests.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from ops.triton_process import free_port


class ServeError(RuntimeError):
    """tandem serve exited or did not become healthy; the message holds its log tail."""


@dataclass
class ServeProcess:
    """`tied`: the serve gets SIGTERM (drains, stops its workers) when the thread that started it dies,
    so a benchmark or test killed midway leaves no deployment running."""

    workdir: str
    args: tuple[str, ...] = ()
    tied: bool = True
    proc: subprocess.Popen | None = None
    grpc_port: int = 0
    http_port: int = 0
    env: dict | None = None  # added to this process's environment (keys, the secret)
    ca: str | None = None  # the serve's doors speak TLS with a certificate this CA signed

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"{'https' if self.ca else 'http'}://127.0.0.1:{self.http_port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=self.ca) if self.ca else None

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "serve.log")

    def start(self, timeout_s: float = 600.0) -> "ServeProcess":
        os.makedirs(self.workdir, exist_ok=True)
        self.grpc_port = free_port()
        self.http_port = free_port([self.grpc_port])
        cmd = [sys.executable, "-m", "cli.main", "serve", "--grpc-port", str(self.grpc_port), "--http-port",
               str(self.http_port), "--workdir", self.workdir, *self.args]
        if self.tied:  # see child_exec.py
            cmd = [sys.executable, "-m", "ops.child_exec", "--tied", str(os.getpid()), "--", *cmd]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServeError(f"tandem serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.http + "/health", timeout=2, context=self.ssl_context()) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise ServeError(f"tandem serve was not healthy within {timeout_s:.0f}s:\n{self.log_tail()}")

    def workers(self) -> dict:
        with open(os.path.join(self.workdir, "workers.json")) as f:
            return json.load(f)

    def log_tail(self, n: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM and wait; returns the exit code (0 for a clean stop)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
