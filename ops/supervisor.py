"""The supervisor of `tandem serve`'s own workers: a worker that dies or stalls is replaced.

- died: its process exits (noticed at once through a pidfd on the event loop, no polling): it is taken
  out of routing, its whole process group is reaped and its shared memory removed, and a replacement
  starts on fresh ports;
- stalled: the fleet's watch of it went silent (a stopped or wedged process): it is out of routing at
  once; if it is still silent after `stall_restart_s` it is killed and replaced the same way. One that
  resumes before then simply rejoins.
Restarts back off (1, 2, 4 ... 30 s) when a worker keeps dying young. The replacement rejoins the fleet
under the same name when its model is ready. When a prefill worker goes, the decode workers are told,
so pages its NIXL writes might still have reached leave quarantine (the NIXL fence, handoff.py); when a
decode worker goes, the prefill workers are told, so pull holds waiting for its NIXL reads to end are
over (engine/workers/holds.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from control.fleet import Fleet, WorkerState
from ops.triton_process import TritonServer
from ops.local_workers import WorkerSet
from tandem.roles import Role

log = logging.getLogger("tandem.supervisor")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
HEALTHY_AFTER_S = 60.0  # a worker that lived this long resets its back-off


class Supervisor:
    def __init__(self, workers: WorkerSet, fleet: Fleet, stall_restart_s: float = 10.0, on_restart=None):
        self.workers, self.fleet, self.stall_restart_s = workers, fleet, stall_restart_s
        self.on_restart = on_restart  # callback(name, server): the stack records the new pid and URL
        self.restarts: dict[str, int] = {}
        self._started: dict[str, float] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._busy: set[str] = set()
        self._closed = False

    def start(self) -> None:
        for name, server in self.workers.servers.items():
            self._watch_process(name, server)

    def _watch_process(self, name: str, server: TritonServer) -> None:
        """Call `_died` when the server's process exits (a pidfd is readable once it has)."""
        loop = asyncio.get_running_loop()
        self._started[name] = time.monotonic()
        try:
            fd = os.pidfd_open(server.proc.pid)
        except ProcessLookupError:
            loop.call_soon(self._died, name, server)
            return

        def exited():
            loop.remove_reader(fd)
            os.close(fd)
            self._died(name, server)

        loop.add_reader(fd, exited)

    def _died(self, name: str, server: TritonServer) -> None:
        if self._closed or self.workers.servers.get(name) is not server:
            return  # stopping, or an old incarnation we replaced already
        code = server.proc.poll()
        log.warning("worker %s exited (code %s); replacing it", name, code)
        self._replace(name)

    def on_health(self, w: WorkerState) -> None:
        """The fleet's health callback: a local worker that went silent gets `stall_restart_s` to come back."""
        if self._closed or w.name not in self.workers.servers or w.healthy or w.name in self._busy:
            return
        task = self._tasks.get(w.name)
        if task is None or task.done():
            self._tasks[w.name] = asyncio.get_running_loop().create_task(self._stalled(w))

    async def _stalled(self, w: WorkerState) -> None:
        """Replace the worker `w` watched if it is still silent `stall_restart_s` from now. Only that
        incarnation: if the fleet routes to another under the name meanwhile (it died and was replaced),
        this stall is over."""
        deadline = time.monotonic() + self.stall_restart_s
        while self.fleet.workers.get(w.name) is w and not w.healthy and time.monotonic() < deadline:
            await self.fleet.wait_change(self.fleet.version, deadline)
        server = self.workers.servers.get(w.name)
        if (self.fleet.workers.get(w.name) is w and not w.healthy and server is not None and server.alive()
                and w.name not in self._busy):
            log.warning("worker %s has been silent for %.0fs; killing and replacing it", w.name,
                        self.stall_restart_s + self.fleet.stall_s)
            self._replace(w.name)

    def _replace(self, name: str) -> None:
        if name in self._busy:
            return
        self._busy.add(name)
        asyncio.get_running_loop().create_task(self._restart(name), name=f"restart-{name}")

    async def _restart(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            w = self.fleet.workers.get(name)
            if w is not None:
                self.fleet.mark_unreachable(w, "its process is being replaced")
            young = time.monotonic() - self._started.get(name, 0.0) < HEALTHY_AFTER_S
            n = self.restarts.get(name, 0) if young else 0
            await asyncio.sleep(BACKOFF_S[min(n, len(BACKOFF_S) - 1)] if n else 0.0)
            await loop.run_in_executor(None, self._reap, name)
            self._tell_peers(name)
            self.workers.launch(name)  # on this (the loop's) thread: the worker is tied to it
            self.restarts[name] = n + 1
            server = await loop.run_in_executor(None, self.workers.wait_ready, name)
            if self._closed:
                return
            self._watch_process(name, server)
            await self.fleet.replace(name, server.grpc_url)
            if self.on_restart is not None:
                self.on_restart(name, server)
            log.info("worker %s is back at %s (restart %d)", name, server.grpc_url, self.restarts[name])
        except Exception:  # a failed restart is logged and tried again: the service must not lose the worker
            self._busy.discard(name)
            if self._closed:
                return  # shutting down: the worker set refused the launch or stopped the new server
            log.exception("restarting worker %s failed; trying again", name)
            self._replace(name)
            return
        self._busy.discard(name)

    def _reap(self, name: str) -> None:
        old = self.workers.servers.get(name)
        if old is not None:
            old.kill()
            old.stop(timeout_s=5.0)  # removes the shared memory its group had mapped

    def _tell_peers(self, name: str) -> None:
        """A dead prefill worker writes no more (decode workers' fence); a dead decode worker reads no more
        (prefill workers' holds)."""
        role = self.workers.specs[name].role
        if role == Role.PREFILL:
            for d in self.fleet.role(Role.DECODE):
                d.client.writer_gone(name)
        elif role == Role.DECODE:
            for p in self.fleet.role(Role.PREFILL):
                p.client.reader_gone(name)

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
