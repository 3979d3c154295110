#!/usr/bin/env python3
"""The equal-hardware benchmark in one command: the handoff, a fresh profile, every layout, the report.

1. `scripts/bench_handoff.py --threads 1 --transports shm` (one prefill worker's thread): the GB/s of a
   512-token prompt's K/V written into another process's pool;
2. `tandem bench compare --suite SUITE --handoff-gbps G --out OUT`, which measures the profile with
   that handoff figure, serves every layout of the cores and writes the report.

    python scripts/bench_equal_hardware.py --out docs/benchmarks/equal-hardware [--suite equal-hardware]
        [--note "quiet machine"] [-- any other `tandem bench compare` options]

Run it on an otherwise idle machine: every number in the report is a wall-clock time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROW = re.compile(r"^\s*shm\s+512\s+[\d.]+\s+([\d.]+)\s", re.MULTILINE)  # transport tokens MB GB/s ...


def handoff_gbps() -> float:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "bench_handoff.py"), "--threads", "1", "--transports",
                           "shm"], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_handoff.py failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    print(proc.stdout, end="")
    match = ROW.search(proc.stdout)
    if match is None:
        sys.exit("bench_handoff.py printed no shm row for 512 tokens; its output format changed?")
    return float(match.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--suite", default="equal-hardware", choices=("equal-hardware", "equal-hardware-quick"))
    ap.add_argument("--note", default="")
    ap.add_argument("rest", nargs="*", help="passed on to tandem bench compare (after --)")
    args = ap.parse_args()
    gbps = handoff_gbps()
    print(f"handoff: {gbps:g} GB/s (shm, 512 tokens)")
    cmd = [sys.executable, "-m", "cli.main", "bench", "compare", "--suite", args.suite, "--handoff-gbps", f"{gbps:g}",
           "--out", args.out, "--note", args.note, *args.rest]
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
