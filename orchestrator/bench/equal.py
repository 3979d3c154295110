"""`tandem bench compare --suite equal-hardware`: the whole run, in order.

1. a hardware profile: the one given, or `tandem profile` measured now on the suite's cores (with the
   handoff GB/s given, e.g. scripts/bench_handoff.py's shm figure), written next to the report;
2. every layout of the suite's cores served in turn (suite.run_layout), the same scenarios on each;
3. the report (equal_report.py, equal_markdown.py) and `tandem plan`'s own output in plan/.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from orchestrator.bench.equal_markdown import write_report
from orchestrator.bench.equal_report import build
from orchestrator.bench.layouts import cores
from orchestrator.bench.suite import Suite, kv_need_bytes, run_layout, settings_for
from planner.profile import Profile, load_profile
from planner.report import write_report as write_plan
from planner.sim.layouts import Layout


@dataclass(frozen=True)
class EqualRun:
    suite: Suite
    layouts: list[Layout]
    cpus: list[int]
    out: str
    model: str = "smollm2-135m"
    protocol: str = "grpc"
    kv_pool_bytes: int = 2 << 30
    chunk_tokens: int = 256
    profile: str | None = None  # a profile file; None: measure one first
    handoff_gbps: float | None = None  # for the measured profile
    note: str = ""  # about the machine (e.g. "shared, busy"), printed in the report
    command: str = ""


def obtain_profile(run: EqualRun, log=print) -> tuple[Profile, str]:
    """(profile, its path): the given one, or one measured now with `tandem profile` on the run's cores."""
    if run.profile:
        return load_profile(run.profile), run.profile
    path = os.path.join(run.out, "profile.json")
    cmd = [sys.executable, "-m", "tandem.cli", "profile", "--out", path, "--model", run.model]
    if run.handoff_gbps:
        cmd += ["--handoff-gbps", f"{run.handoff_gbps:g}"]
    log(f"measuring a profile on cores {run.cpus}: {' '.join(cmd[1:])}")
    os.makedirs(run.out, exist_ok=True)
    with cores(run.cpus):
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tandem profile failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return load_profile(path), path


def run_equal_hardware(run: EqualRun, tokenizer, log=print) -> dict:
    """Everything above; returns the report document (also written to run.out)."""
    load_before = _load()
    profile, profile_path = obtain_profile(run, log)
    scenarios = run.suite.scenarios()
    settings = settings_for(scenarios, run.model, run.kv_pool_bytes, run.chunk_tokens)
    work = tempfile.mkdtemp(prefix="tandem-equal-")
    results = {x.name: run_layout(scenarios, x, run.cpus, settings, run.protocol, tokenizer, work, log)
               for x in run.layouts}
    context = {"command": run.command, "cpus": run.cpus, "protocol": run.protocol, "profile_file": profile_path,
               "machine": {"load_before": load_before, "load_after": _load(), "note": run.note},
               "kv_pool_bytes": run.kv_pool_bytes, "chunk_tokens": run.chunk_tokens,
               "kv_need_bytes": kv_need_bytes(run.suite, profile.model.kv_bytes_per_token),
               "limits": {"max_in_flight": settings.max_in_flight, "max_queued_tokens": settings.max_queued_tokens}}
    doc = build(run.suite, run.layouts, results, profile, run.kv_pool_bytes, run.chunk_tokens, context)
    write_report(doc, results, run.out)
    write_plan(doc["plan"], os.path.join(run.out, "plan"))
    return doc


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
