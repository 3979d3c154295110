#!/usr/bin/env python3
"""Idle CPU of a served stack: start `tandem serve`, wait until /health says 200, then sum the CPU time
(utime + stime from /proc/<pid>/stat) of the serve process and all its descendants over `--seconds`
with no request sent, and print it as % of one core.

Standard library only, so it measures any checkout: `--python` names the interpreter whose `cli.main`
is served, `--cwd` the checkout it runs in, `--module` its `tandem` command's module (cli.main; tandem.cli
before the layout step). Extra arguments after `--` go to `tandem serve`.

    python scripts/idle_cpu.py [--seconds 60] [--python .venv/bin/python] [--cwd .] -- --model engines/smollm2-135m
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def tree(root: int) -> set[int]:
    """`root` and every process descended from it."""
    parents, found, grew = children(), {root}, True
    while grew:
        new = {pid for pid, ppid in parents.items() if ppid in found} - found
        found |= new
        grew = bool(new)
    return found


def cpu_seconds(pids: set[int]) -> dict[int, float]:
    """pid -> utime + stime so far (seconds), for the pids still alive."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    add_serve_args(ap)
    args = ap.parse_args()
    with served(args) as (proc, _):
        pids = tree(proc.pid)
        start, t0 = cpu_seconds(pids), time.monotonic()
        time.sleep(args.seconds)
        end, elapsed = cpu_seconds(pids | tree(proc.pid)), time.monotonic() - t0
        used = sum(end[p] - start.get(p, 0.0) for p in end)
        print(json.dumps({"processes": len(end), "seconds": round(elapsed, 1), "cpu_seconds": round(used, 2),
                          "percent_of_one_core": round(100 * used / elapsed, 2), "load": os.getloadavg()}))


def add_serve_args(ap: argparse.ArgumentParser) -> None:
    """The options `served` reads: which checkout to serve, how, and how long it may take to start."""
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the checkout to serve")
    ap.add_argument("--cwd", default=".", help="the checkout to serve from")
    ap.add_argument("--module", default="cli.main", help="the module of its tandem command")
    ap.add_argument("--timeout", type=float, default=600.0, help="how long the stack may take to become healthy")
    ap.add_argument("serve_args", nargs="*", help="after --: arguments for tandem serve")


@contextlib.contextmanager
def served(args: argparse.Namespace):
    """`tandem serve` of args.cwd on free ports, healthy and settled: yields (its process, its HTTP port);
    stopped (with every process it started) on leaving."""
    workdir = tempfile.mkdtemp(prefix="tandem-bench-")
    http = free_port()
    cmd = [args.python, "-m", args.module, "serve", "--grpc-port", str(free_port()), "--http-port", str(http),
           "--workdir", workdir, *args.serve_args]
    log = open(os.path.join(workdir, "serve.log"), "w")
    proc = subprocess.Popen(cmd, cwd=args.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"tandem serve did not become healthy; see {log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        time.sleep(5.0)  # let start-up work (first stats, watches connecting) finish
        yield proc, http
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the serve's process group (it drains and stops its workers); SIGKILL after 60 s."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":
    main()
