"""A set of role workers: Triton instances for x prefill and y decode workers (or one co-located).

One model repository is rendered for the deployment; each Triton instance loads only its role's
model from it. With TensorRT-LLM role engines (backend "tensorrt-llm") there is one repository per
worker (builder/trtllm_repo.py: DIR/prefill_0, ...), each placing its engine on its GPUs itself. Workers are pinned to disjoint CPU cores where there are enough cores (round-robin
single cores otherwise), with as many torch threads as cores. Workers of a CUDA role each get a GPU
and see it as their device 0 (ops/gpu_plan.py).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from builder.repo import RepoOptions, render_repo
from builder.trtllm_repo import render_trtllm_repo
from ops.gpu_plan import worker_env
from ops.triton_process import TritonError, TritonServer, free_port
from tandem.roles import Role


@dataclass(frozen=True)
class WorkerSpec:
    role: Role
    index: int
    cpus: tuple[int, ...]

    @property
    def name(self) -> str:
        """<role>-<index>: a label for logs, files and metrics; the role is `role`, never parsed from this."""
        return f"{self.role}-{self.index}"


def plan_cpus(counts: dict[Role, int], cpus: list[int] | None = None) -> list[WorkerSpec]:
    """Give each worker its own cores: an equal share when there are enough, one core each (shared) if not."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    roles = [(r, i) for r in Role for i in range(counts.get(r, 0))]
    if not roles:
        raise ValueError("a deployment needs at least one worker")
    share = max(1, len(cpus) // len(roles))
    specs = []
    for k, (role, i) in enumerate(roles):
        if share * len(roles) <= len(cpus):
            mine = tuple(cpus[k * share:(k + 1) * share])
        else:
            mine = (cpus[k % len(cpus)],)
        specs.append(WorkerSpec(role, i, mine))
    return specs


log = logging.getLogger("tandem.workers")


class WorkerSetClosed(RuntimeError):
    """A launch was asked of a worker set that is stopping."""

START_ATTEMPTS = 3  # a worker that fails to start (e.g. a port taken after we chose it) is retried on new ports


@dataclass
class WorkerSet:
    """Local Triton workers. `launch` only starts a process (call it from a thread that lives as long as
    the workers: they are tied to it); `wait_ready` blocks until a server is ready. Once `stop` has
    begun, `launch` refuses (WorkerSetClosed): a restart racing with shutdown cannot leave a server
    behind."""

    engines: str
    workdir: str
    counts: dict[Role, int]
    options: RepoOptions = field(default_factory=RepoOptions)
    gpus: dict[str, tuple[int, ...]] = field(default_factory=dict)  # CUDA roles' GPUs (ops/gpu_plan.role_gpus)
    cpus: list[int] | None = None
    nice: int = 0  # the servers' CPU priority below ours (TritonServer.nice)
    detached: bool = False  # True: the servers outlive this process (tandem workers up)
    tls: tuple[str, str] | None = None  # (certificate, key): the servers' gRPC serves TLS (TritonServer.tls)
    backend: str = "torch"  # or "tensorrt-llm": `engines` holds TensorRT-LLM role folders
    gpus_per_node: int = 0  # tensorrt-llm: GPUs its engines are placed on in order; 0: Triton KIND_CPU (test double)
    env: dict = field(default_factory=dict)  # added to every server's environment (e.g. tracing settings)
    avoid_ports: tuple[int, ...] = ()  # promised elsewhere, bound later (the front door's): no server takes them
    servers: dict[str, TritonServer] = field(default_factory=dict)
    specs: dict[str, WorkerSpec] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _closed: bool = False

    def prepare(self) -> None:
        """Plan the cores and render the model repository (once)."""
        specs = plan_cpus(self.counts, self.cpus)
        self.specs = {s.name: s for s in specs}
        if self.backend == "tensorrt-llm":
            render_trtllm_repo(self.engines, self.repo, self.counts.get("prefill", 0), self.counts.get("decode", 0),
                               max(1, self.gpus_per_node), on_gpu=self.gpus_per_node > 0)
            return
        threads = min(len(s.cpus) for s in specs)
        on_gpu = tuple((role, 0) for role in self.gpus)  # each worker sees its own GPU as device 0
        render_repo(self.engines, self.repo, RepoOptions(**{**self.options.__dict__, "threads": threads,
                                                            "gpus": on_gpu}))

    @property
    def repo(self) -> str:
        return os.path.join(self.workdir, "model_repository")

    def launch(self, name: str) -> TritonServer:
        spec = self.specs[name]
        with self._lock:
            if self._closed:
                raise WorkerSetClosed(f"not starting {name}: the workers are being stopped")
            repo = self.repo if self.backend == "torch" else os.path.join(self.repo, f"{spec.role}_{spec.index}")
            ports: list[int] = []
            for _ in range(3):  # gRPC, HTTP, metrics: distinct, and none of the front door's
                ports.append(free_port([*self.avoid_ports, *ports]))
            server = TritonServer(repo, (spec.role,), name=spec.name, cpus=spec.cpus, nice=self.nice,
                                  grpc_port=ports[0], http_port=ports[1], metrics_port=ports[2],
                                  log_dir=self.workdir, tied=not self.detached, tls=self.tls,
                                  env={**self.env, **worker_env(self.gpus, spec.role, spec.index)}).launch()
            self.servers[name] = server
        return server

    def wait_ready(self, name: str, timeout_s: float = 300.0) -> TritonServer:
        """Block until the worker is ready; relaunch it on fresh ports when it exits while starting."""
        for attempt in range(START_ATTEMPTS):
            server = self.servers[name]
            try:
                server.wait_ready(timeout_s)
                return server
            except TritonError as e:
                if server.alive() or attempt == START_ATTEMPTS - 1:
                    raise
                log.warning("worker %s failed to start (%s); trying again on new ports", name,
                            str(e).splitlines()[0])
                server.stop()
                self.launch(name)
        raise AssertionError("unreachable")

    def start(self, timeout_s: float = 300.0) -> "WorkerSet":
        self.prepare()
        try:
            for name in self.specs:
                self.launch(name)
            for name in self.specs:
                self.wait_ready(name, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def urls(self, role: Role) -> list[str]:
        return [s.grpc_url for name, s in sorted(self.servers.items()) if self.specs[name].role == role]

    def stop(self) -> None:
        """Stop every server at once (each takes a few seconds to unload its model; not one after another)."""
        with self._lock:
            self._closed = True
            servers = list(self.servers.values())
            self.servers.clear()
        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
            list(pool.map(lambda server: server.stop(), servers))
