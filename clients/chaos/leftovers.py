"""What one `tandem chaos --serve` deployment left behind once it stopped, and nothing of anyone else's.

The machine may run other deployments and test suites at the same time, each starting and stopping
its own tritonserver processes, python-backend stubs and shared memory. A check that compared the
whole machine before and after the run would count theirs as ours. So the deployment is tagged: its
serve process gets a run tag in its environment, which its workers (tritonserver) and their stubs
inherit. While the run lasts, `Tracker` looks every `period_s` at the tagged processes and notes
them (pid and start time) and the /dev/shm files they map. After the stop, a leftover is:

- a process that carries the tag (the serve itself, a tritonserver, a stub);
- a /dev/shm file that a tagged process mapped, or a Tandem segment whose name says a tagged process
  made it (tandem-<tag>-<pid>.<start>-...), that still exists.

A process that lived less than `period_s` between two looks is not noted; every worker lives for
seconds at least (it loads a model), so this misses nothing a real worker leaves.
"""

from __future__ import annotations

import os
import secrets
import threading

from engine.shm_region import SHM_DIR, SHM_PREFIX, TRITON_PREFIX

TAG_VAR = "TANDEM_CHAOS_RUN"


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None  # the process ended while we looked, or is not ours to read


class Tracker:
    """Notes the tagged processes of one run and the shared memory they map (see the module docstring)."""

    def __init__(self, period_s: float = 0.5):
        self.tag = f"{TAG_VAR}={secrets.token_hex(8)}"
        self.period_s = period_s
        self.owners: set[str] = set()  # "<pid>.<start ticks>" of every tagged process seen
        self.shm: set[str] = set()  # /dev/shm file names a tagged process mapped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def env(self) -> dict[str, str]:
        """What the serve process's environment gets (its workers and stubs inherit it)."""
        key, _, value = self.tag.partition("=")
        return {key: value}

    def start(self) -> "Tracker":
        self._thread = threading.Thread(target=self._watch, name="chaos-leftovers", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop looking (take one last look first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while True:
            self.look()
            if self._stop.wait(self.period_s):
                self.look()
                return

    def tagged(self) -> list[tuple[str, bytes]]:
        """(pid, /proc/<pid>/stat) of every live process that carries this run's tag."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            environ = _read(f"/proc/{pid}/environ")
            if environ is not None and self.tag.encode() in environ.split(b"\0"):
                stat = _read(f"/proc/{pid}/stat")
                if stat is not None:
                    found.append((pid, stat))
        return found

    def look(self) -> None:
        """Note the tagged processes alive now and the /dev/shm files they map."""
        for pid, stat in self.tagged():
            start = stat.rsplit(b")", 1)[1].split()[19].decode()
            self.owners.add(f"{pid}.{start}")
            maps = _read(f"/proc/{pid}/maps") or b""
            for line in maps.decode(errors="replace").splitlines():
                if " /dev/shm/" in line:
                    self.shm.add(os.path.basename(line.split(None, 5)[5].replace(" (deleted)", "").strip()))

    def leftovers(self) -> list[str]:
        """What of this run exists now: its processes, then its shared memory (see the module docstring)."""
        found = []
        for pid, _ in self.tagged():
            argv0 = (_read(f"/proc/{pid}/cmdline") or b"").split(b"\0")[0]
            found.append(f"process {pid} {os.path.basename(argv0.decode(errors='replace'))}")
        for name in sorted(os.listdir(SHM_DIR)):
            if not name.startswith((SHM_PREFIX, TRITON_PREFIX)):
                continue
            parts = name[len(SHM_PREFIX):].split("-") if name.startswith(SHM_PREFIX) else []
            made_by_us = len(parts) >= 3 and parts[1] in self.owners
            if name in self.shm or made_by_us:
                found.append(f"shm {name}")
        return found
