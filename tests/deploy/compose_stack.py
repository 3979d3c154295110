"""A Compose project driven from Python: up, health, a container's crash, logs, down, and what is left.

Used by scripts/compose-test (tests/deploy/compose_check.py). Every resource Compose makes carries the
project's label, so "nothing left" is checked by that label; the stack's secret lives in a private
temporary folder removed with it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

SECRET_UID = 1000  # the images' user: the secret file is handed to it, readable by it alone


def sh(argv: list[str], env: dict | None = None, check: bool = True, timeout: float = 600) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")
    return proc.stdout


@dataclass
class Stack:
    file: str
    image: str
    http_port: int
    grpc_port: int
    project: str = field(default_factory=lambda: f"tandem-ct-{secrets.token_hex(3)}")
    secret_dir: str = ""
    up_output: str = ""

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, TANDEM_IMAGE=self.image, TANDEM_HTTP_PORT=str(self.http_port),
                    TANDEM_GRPC_PORT=str(self.grpc_port),
                    TANDEM_COMPOSE_SECRET=os.path.join(self.secret_dir, "tandem.secret"),
                    TANDEM_COMPOSE_TLS=os.path.join(self.secret_dir, "tls"))

    @staticmethod
    def _worker_tls(folder: str) -> None:
        """ca.crt and, signed by it, tls.crt/tls.key for the name tandem-worker (the stack's worker_tls)."""
        from tests.serve.certs import TestCA

        os.makedirs(folder)
        ca = TestCA(folder, name="ca")
        ca.issue("tls", dns=("tandem-worker",), ips=())
        os.chmod(folder, 0o755)  # mounted whole: the folder itself must be open to the containers' user
        if os.geteuid() == 0:
            for name in os.listdir(folder):
                os.chown(os.path.join(folder, name), SECRET_UID, SECRET_UID)

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        return sh(["docker-compose", "-p", self.project, "-f", self.file, *args], env=self.env, check=check,
                  timeout=timeout)

    def up(self) -> None:
        """Write a fresh secret (owner-only, for the image's user), then start every service detached."""
        self.secret_dir = tempfile.mkdtemp(prefix="tandem-ct-secret-")
        path = os.path.join(self.secret_dir, "tandem.secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        if os.geteuid() == 0:  # the containers see the file itself (a bind mount), not this 0700 folder
            os.chown(path, SECRET_UID, SECRET_UID)
        self._worker_tls(os.path.join(self.secret_dir, "tls"))
        # `up` itself fails while a dependency is unhealthy; wait_healthy then reports why, with logs.
        proc = subprocess.run(["docker-compose", "-p", self.project, "-f", self.file, "up", "-d", "--no-build"],
                              capture_output=True, text=True, env=self.env, timeout=900)
        self.up_output = proc.stdout + proc.stderr

    def start_front(self, timeout: float) -> None:
        """Workers healthy first (their failures are the informative ones), then the orchestrator, which
        `up` does not create while a worker it depends on is still unhealthy."""
        self.wait_healthy(["prefill", "decode"], timeout)
        if not self.compose("ps", "-q", "orchestrator").split():
            self.compose("up", "-d", "--no-build", "orchestrator")
        self.wait_healthy(["prefill", "decode", "orchestrator"], timeout)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service).split()
        if not ids:
            raise RuntimeError(f"service {service} has no container; `up` said: {self.up_output.strip()[-800:]}")
        return ids[0]

    def state(self, service: str) -> dict:
        """Docker's State of the service's container plus its RestartCount."""
        info = json.loads(sh(["docker", "inspect", self.container(service)]))[0]
        return dict(info["State"], RestartCount=info["RestartCount"])

    def logs(self, service: str, lines: int = 25) -> str:
        return self.compose("logs", "--no-color", "--tail", str(lines), service, check=False)

    def wait_healthy(self, services: list[str], timeout: float) -> None:
        """Until every service's health check passes; fails early when one crash-loops or exits for good."""
        deadline = time.monotonic() + timeout
        while True:
            states = {s: self.state(s) for s in services}
            if all(st.get("Health", {}).get("Status") == "healthy" for st in states.values()):
                return
            for s, st in states.items():
                if st["RestartCount"] >= 3 or (st["Status"] == "exited" and st.get("ExitCode") not in (None, 137)):
                    raise RuntimeError(f"{s} keeps failing (restarts {st['RestartCount']}, status {st['Status']}, "
                                       f"exit {st.get('ExitCode')}); its log:\n{self.logs(s)}")
            if time.monotonic() > deadline:
                detail = {s: (st["Status"], st.get("Health", {}).get("Status")) for s, st in states.items()}
                raise RuntimeError(f"not healthy after {timeout:.0f} s: {detail}\n"
                                   + "\n".join(self.logs(s, 10) for s in services))
            time.sleep(2)

    def crash(self, service: str) -> int:
        """SIGKILL the container's main process from the host, as a crash would (a `docker kill` counts as a
        manual stop, which restart policies ignore). Returns the restart count before the crash."""
        st = self.state(service)
        os.kill(st["Pid"], 9)
        return st["RestartCount"]

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False)
        if self.secret_dir:
            shutil.rmtree(self.secret_dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes of this project, and its secret folder, that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        found = [f"container {c}" for c in sh(["docker", "ps", "-aq", "--filter", label]).split()]
        found += [f"network {n}" for n in sh(["docker", "network", "ls", "-q", "--filter", label]).split()]
        found += [f"volume {v}" for v in sh(["docker", "volume", "ls", "-q", "--filter", label]).split()]
        if self.secret_dir and os.path.exists(self.secret_dir):
            found.append(f"secret folder {self.secret_dir}")
        return found
