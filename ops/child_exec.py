"""Exec a program pinned to some cores, optionally nicer than its parent (a lower CPU priority, which
every thread and child it makes inherits), and optionally tied to its parent (it gets SIGTERM when
the thread that started it dies), without `preexec_fn`, which can crash a child forked from a
multithreaded process (gRPC and asyncio threads): this runs in a fresh interpreter, then execs.

    python -m ops.child_exec [--cpus 0,1] [--nice 10] [--tied PARENT_PID] -- PROGRAM ARGS...
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _lower_priority(increment: int) -> None:
    """Nicer by `increment`, and so is our session's scheduling group where the kernel groups by session
    (autogroup): there, CPU is shared fairly between sessions first, so a process started in a session
    of its own (as the workers are) would otherwise compete at full weight whatever its nice value."""
    nice = os.nice(increment)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup on this kernel: the nice value alone sets the priority


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit("usage: child_exec [--cpus LIST] [--nice N] [--tied PID] -- PROGRAM ARGS...")
    split = argv.index("--")
    opts, program = argv[:split], argv[split + 1:]
    cpus = opts[opts.index("--cpus") + 1] if "--cpus" in opts else None
    nice = int(opts[opts.index("--nice") + 1]) if "--nice" in opts else 0
    tied = int(opts[opts.index("--tied") + 1]) if "--tied" in opts else None
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    if nice:
        _lower_priority(nice)
    if tied is not None:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != tied:  # the parent died before we could tie ourselves to it
            sys.exit(1)
    os.execv(program[0], program)


if __name__ == "__main__":
    main(sys.argv[1:])
