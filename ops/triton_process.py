"""Start and stop real Triton Inference Server processes (which binary: ops/triton_binary.py).

The server runs our model repository with the python backend. Its stub processes use the `python3`
first on PATH, so this environment's bin/ goes first and `import torch` works inside model.py.
Every port is bound on 127.0.0.1; a server can be pinned to a set of CPU cores (its stubs inherit
the pinning). `stop` ends the whole process group and removes shared memory its stubs left.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.shm_region import (SHM_PREFIX, mapped_shm_files, owner_alive, process_started_at,
                                remove_orphaned_triton_regions, remove_stale_segments)
from ops.triton_binary import TritonError, find_triton
from tandem.secret import is_loopback


_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `orchestrator` imports from


def free_port(avoid: Collection[int] = ()) -> int:
    """A port free on 127.0.0.1 now (the kernel's choice), other than those in `avoid` (ports promised
    to someone who has not bound them yet). Nothing holds it: a caller binds it soon, or retries."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


@dataclass
class TritonServer:
    repository: str
    models: tuple[str, ...]  # loaded explicitly; nothing else in the repository is
    name: str = "triton"
    cpus: tuple[int, ...] | None = None  # pin the server and its stubs to these cores
    nice: int = 0  # run the server and its stubs this much nicer than us (see Deployment.worker_nice)
    grpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    log_dir: str | None = None
    env: dict = field(default_factory=dict)
    tied: bool = True  # the server gets SIGTERM if the thread that started it dies (no orphans)
    host: str = "127.0.0.1"  # the address it listens on (beyond loopback: see command())
    log_stdout: bool = False  # the server's log goes to our stdout (a container) instead of a file
    tls: tuple[str, str] | None = None  # (certificate, key) PEM files: its gRPC endpoint serves TLS
    proc: subprocess.Popen | None = None
    shm_files: set = field(default_factory=set)  # /dev/shm files its processes mapped once ready
    launched_at: float | None = None  # epoch seconds of the last launch (regions made since are its own)

    @property
    def local_host(self) -> str:
        """Where this machine reaches it: its address, or loopback when it listens on every interface."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host

    @property
    def grpc_url(self) -> str:
        return f"{self.local_host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.local_host}:{self.http_port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.log_dir or tempfile.gettempdir(), f"tandem-{self.name}-{self.grpc_port}.log")

    def command(self) -> list[str]:
        binary = find_triton()
        h = self.host
        cmd = [binary.path, f"--model-repository={os.path.abspath(self.repository)}",
               f"--backend-directory={binary.backends}", "--model-control-mode=explicit",
               f"--grpc-address={h}", f"--grpc-port={self.grpc_port}",
               f"--http-address={h}", f"--http-port={self.http_port}",
               f"--metrics-address={h}", f"--metrics-port={self.metrics_port}",
               "--exit-timeout-secs=10", "--log-verbose=0", "--strict-readiness=true"]
        if self.tls:
            cmd += ["--grpc-use-ssl=true", f"--grpc-server-cert={self.tls[0]}", f"--grpc-server-key={self.tls[1]}"]
        return cmd + self._locked_admin() + [f"--load-model={m}" for m in self.models]

    def _locked_admin(self) -> list[str]:
        """Beyond loopback, Triton's admin APIs (model load/unload, shared-memory registration, traces,
        logging, statistics, configs) answer only a header whose value is a random key made here and
        given to no one: nobody can use them. Inference is guarded by the deployment secret, which the
        models check (engine/triton/common.py); health and metadata stay open for probes."""
        if is_loopback(self.host):
            return []
        groups = "model-repository,model-config,shared-memory,statistics,trace,logging"
        key = secrets.token_hex(16)
        return [f"--grpc-restricted-protocol={groups}:tandem-admin={key}",
                f"--http-restricted-api={groups}:tandem-admin={key}"]

    def start(self, timeout_s: float = 180.0) -> "TritonServer":
        """Launch and wait until every model is ready (the server is stopped again on failure)."""
        self.launch()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> "TritonServer":
        """Start the process without waiting for readiness (see wait_ready)."""
        libs = find_triton().libs
        env = dict(os.environ, **self.env)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        if libs:
            env["LD_LIBRARY_PATH"] = libs + os.pathsep + env.get("LD_LIBRARY_PATH", "")
        if self.cpus:
            env.setdefault("OMP_NUM_THREADS", str(len(self.cpus)))
        wrap = [sys.executable, "-m", "ops.child_exec"]  # pins and ties it; see child_exec.py
        if self.cpus:
            wrap += ["--cpus", ",".join(map(str, self.cpus))]
        if self.nice:
            wrap += ["--nice", str(self.nice)]
        if self.tied:
            wrap += ["--tied", str(os.getpid())]
        log = None if self.log_stdout else open(self.log_path, "w")
        self.launched_at = time.time()
        self.proc = subprocess.Popen(wrap + ["--"] + self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=_PROJECT_ROOT)
        if log is not None:
            log.close()
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TritonError(f"{self.name} exited with {self.proc.returncode} while starting (log: "
                                  f"{self.log_path if not self.log_stdout else 'above'})\n{self.log_tail()}")
            if all(self._ready(m) for m in self.models):
                self.shm_files = mapped_shm_files(self.proc.pid)  # to clean up even after a hard kill
                return
            time.sleep(0.25)
        raise TritonError(f"{self.name} was not ready within {timeout_s:.0f}s:\n{self.log_tail()}")

    def _ready(self, model: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{model}/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server and every process in its group; remove shared memory they left."""
        if self.proc is not None:
            stop_group(self.proc.pid, timeout_s, self.proc, self.shm_files, self.launched_at)

    def kill(self) -> None:
        """Kill without warning (failure tests): SIGKILL to the whole group."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def stop_group(pgid: int, timeout_s: float = 20.0, proc: subprocess.Popen | None = None,
               known_shm: set | None = None, launched_at: float | None = None) -> None:
    """Stop a server: SIGTERM to the server (it unloads its models, whose stubs clean up), SIGKILL to
    whatever of its group is left after `timeout_s`; then unlink shared memory the group had mapped
    (but not a live peer's pool it only mapped: a pull reader maps its prefill worker's pool),
    and Triton regions that nobody maps and that were made since `launched_at` (default: when the
    group's leader started)."""
    mapped = mapped_shm_files(pgid) | (known_shm or set())
    started = launched_at if launched_at is not None else process_started_at(pgid)
    try:
        os.kill(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # already gone
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _group_alive(pgid) and (proc is None or proc.poll() is None):
        time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)
    if proc is not None:
        proc.wait(timeout=10)
    _wait_group_gone(pgid)
    for path in mapped:
        name = os.path.basename(path)
        if name.startswith(SHM_PREFIX) and owner_alive(name):
            continue  # a live peer's pool the group only mapped (a KV writer's or reader's view): not ours
        if os.path.exists(path):
            os.unlink(path)
    remove_stale_segments()
    if started is not None:
        remove_orphaned_triton_regions(made_since=started - 1.0)  # st_mtime and start ticks round differently


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _wait_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.05)
