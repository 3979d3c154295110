"""A set of role workers: Triton instances for x prefill and y decode workers (or one co-located).

One model repository is rendered for the deployment; each Triton instance loads only its role's
model from it. Workers are pinned to disjoint CPU cores where there are enough cores (round-robin
single cores otherwise), with as many torch threads as cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from builder.repo import RepoOptions, render_repo
from orchestrator.triton_process import TritonServer


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # prefill | decode | generate
    index: int
    cpus: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def plan_cpus(counts: dict[str, int], cpus: list[int] | None = None) -> list[WorkerSpec]:
    """Give each worker its own cores: an equal share when there are enough, one core each (shared) if not."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    roles = [(r, i) for r in ("prefill", "decode", "generate") for i in range(counts.get(r, 0))]
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


@dataclass
class WorkerSet:
    engines: str
    workdir: str
    counts: dict[str, int]
    options: RepoOptions = field(default_factory=RepoOptions)
    cpus: list[int] | None = None
    detached: bool = False  # True: the servers outlive this process (tandem workers up)
    servers: dict[str, TritonServer] = field(default_factory=dict)

    def start(self, timeout_s: float = 300.0) -> "WorkerSet":
        specs = plan_cpus(self.counts, self.cpus)
        threads = min(len(s.cpus) for s in specs)
        repo = os.path.join(self.workdir, "model_repository")
        render_repo(self.engines, repo, RepoOptions(**{**self.options.__dict__, "threads": threads}))
        try:
            for spec in specs:
                self.servers[spec.name] = TritonServer(repo, (spec.role,), name=spec.name, cpus=spec.cpus,
                                                       log_dir=self.workdir, tied=not self.detached).launch()
            for server in self.servers.values():
                server.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def urls(self, role: str) -> list[str]:
        return [s.grpc_url for name, s in sorted(self.servers.items()) if name.startswith(role + "-")]

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
