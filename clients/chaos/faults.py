"""How the harness hurts a deployment: signals to the process groups of `tandem serve`'s workers.

The workers of a running `tandem serve` are listed in its workdir's workers.json (pids change when
the supervisor replaces one, so the file is read again for every fault). Faults on other kinds of
deployments (containers, pods) would be one more class with the same two methods.
"""

from __future__ import annotations

import json
import os
import signal


class LocalTarget:
    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, "workers.json")

    def workers(self) -> dict:
        with open(self.path) as f:
            return json.load(f)

    def pid(self, worker: str) -> int:
        workers = self.workers()
        if worker not in workers:
            raise ValueError(f"no worker {worker!r} in {self.path}; it has {sorted(workers)}")
        return int(workers[worker]["pid"])

    def kill(self, worker: str) -> int:
        """SIGKILL the worker's whole process group (server and stubs), like an OOM kill or a crash."""
        pid = self.pid(worker)
        os.killpg(pid, signal.SIGKILL)
        return pid

    def stop(self, worker: str) -> int:
        pid = self.pid(worker)
        os.killpg(pid, signal.SIGSTOP)
        return pid

    def resume(self, pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # the supervisor replaced it meanwhile: nothing left to resume
