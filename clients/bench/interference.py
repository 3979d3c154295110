"""How much of the machine something else used while a benchmark ran.

On a shared machine a run's wall-clock times include whatever other processes took from its cores,
so every run records it: the CPU seconds the whole machine was busy, minus those of our own process
tree (this process, the `tandem serve` process and its workers), per second of the run, in cores.
A run with others near 0 measured our system; one with others at a whole core did not. A process
of ours that ends during the window takes its CPU seconds with it (they count as others'): a
suite's workers live through every scenario, so that is only a worker restarted by the supervisor.
"""

from __future__ import annotations

import time

import psutil


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _tree(roots: list[int]) -> dict[int, psutil.Process]:
    out: dict[int, psutil.Process] = {}
    for pid in roots:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                out[p.pid] = p
        except psutil.NoSuchProcess:
            continue  # a root that already ended has nothing left to count
    return out


def _cpu_s(procs: dict[int, psutil.Process]) -> dict[int, float]:
    out = {}
    for pid, p in procs.items():
        try:
            t = p.cpu_times()
            out[pid] = t.user + t.system
        except psutil.NoSuchProcess:
            continue  # ended between listing and reading: its last seconds are lost (a worker restart)
    return out


class CpuMeter:
    def __init__(self, roots: list[int]):
        """`roots`: pids whose whole process trees are ours."""
        self.roots = roots

    def __enter__(self) -> "CpuMeter":
        self.t0, self.busy0 = time.monotonic(), _busy_s()
        self.ours0 = _cpu_s(_tree(self.roots))
        self.result: dict = {}
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self.t0
        busy = _busy_s() - self.busy0
        ours = sum(s - self.ours0.get(pid, 0.0) for pid, s in _cpu_s(_tree(self.roots)).items())
        self.result = {"wall_s": wall, "machine_busy_cores": busy / wall if wall else 0.0,
                       "ours_cores": ours / wall if wall else 0.0,
                       "others_cores": max(0.0, busy - ours) / wall if wall else 0.0}
