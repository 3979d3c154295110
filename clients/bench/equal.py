"""`tandem bench compare --suite equal-hardware`: the whole run, in order.

1. a hardware profile: the one given, or `tandem profile --served` measured now on the suite's cores
   (with the handoff GB/s given, e.g. scripts/bench_handoff.py's shm figure), written next to the
   report; a sweep given `around` the predicted capacity gets its rates from it (equal_report.bracket),
   unless resumed runs were served at rates of their own (runs.json keeps them: a report rebuilt with
   another profile compares the same runs);
2. every layout of the suite's cores served in turn (suite.run_layout), the same scenarios on each;
   each layout's records are saved to runs.json as soon as it is done, and `resume` reuses the
   layouts found there (a long run that stopped, or a report rebuilt without serving anything);
3. the report (equal_report.py, equal_markdown.py) and `tandem plan`'s own output in plan/.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from clients.bench.equal_markdown import write_report
from clients.bench.equal_report import bracket, build
from clients.bench.bench_layouts import cores
from clients.bench.bench_report import records_json, write_json
from clients.bench.stats import RequestRecord
from clients.bench.suite import Suite, kv_need_bytes, run_layout, settings_for
from planner.profile import Profile, load_profile
from planner.plan_report import write_report as write_plan
from planner.sim.sim_layouts import Layout


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
    resume: bool = False  # reuse the layouts already in out/runs.json (same suite and cores)


def obtain_profile(run: EqualRun, log=print) -> tuple[Profile, str]:
    """(profile, its path): the given one, or one measured now with `tandem profile` on the run's cores."""
    if run.profile:
        return load_profile(run.profile), run.profile
    path = os.path.join(run.out, "profile.json")
    cmd = [sys.executable, "-m", "cli.main", "profile", "--served", "--out", path, "--model", run.model]
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
    saved = _saved(run) if run.resume else {}
    load_before = saved.get("load_before") or _load()
    if saved.get("profile_file") and not run.profile:  # the profile measured before the saved runs
        run = dataclasses.replace(run, profile=saved["profile_file"])
    profile, profile_path = obtain_profile(run, log)
    suite, how = _with_rates(run, saved, profile, profile_path)
    if how:
        chosen_on = how.get("profile_file", "the saved profile")
        log(f"sweep: {', '.join(f'{r:g}' for r in how['rates'])} req/s ({', '.join(f'{f:g}' for f in how['around'])}"
            f" x {how['center']:.3g} req/s, the capacity the planner predicted on {chosen_on})")
    scenarios = suite.scenarios()
    settings = settings_for(scenarios, run.model, run.kv_pool_bytes, run.chunk_tokens)
    work = tempfile.mkdtemp(prefix="tandem-equal-")
    results = {name: _records_of(r) for name, r in saved.get("results", {}).items()}
    for x in run.layouts:
        if x.name in results:
            log(f"[{x.name}] reusing the runs in {os.path.join(run.out, 'runs.json')}")
            continue
        results[x.name] = run_layout(scenarios, x, run.cpus, settings, run.protocol, tokenizer, work, log)
        _save(run, results, load_before, profile_path, how)
    results = {x.name: results[x.name] for x in run.layouts}
    context = {"command": run.command, "cpus": run.cpus, "protocol": run.protocol, "profile_file": profile_path,
               "machine": {"load_before": load_before, "load_after": _load(), "note": run.note},
               "kv_pool_bytes": run.kv_pool_bytes, "chunk_tokens": run.chunk_tokens,
               "kv_need_bytes": kv_need_bytes(suite, profile.model.kv_bytes_per_token), "sweep_rates": how,
               "limits": {"max_in_flight": settings.max_in_flight, "max_queued_tokens": settings.max_queued_tokens}}
    doc = build(suite, run.layouts, results, profile, run.kv_pool_bytes, run.chunk_tokens, context)
    write_report(doc, results, run.out)
    write_plan(doc["plan"], os.path.join(run.out, "plan"))
    return doc


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _with_rates(run: EqualRun, saved: dict, profile: Profile, profile_path: str) -> tuple[Suite, dict]:
    """(the suite with its sweep's rates, how they were chosen and on which profile file): the saved runs'
    rates, or bracketed now on `profile`."""
    how = saved.get("sweep_rates")
    if how:
        sweep = dataclasses.replace(run.suite.sweep, rates=tuple(how["rates"]))
        return dataclasses.replace(run.suite, sweep=sweep), how
    suite, how = bracket(run.suite, run.layouts, profile, run.kv_pool_bytes, run.chunk_tokens, len(run.cpus))
    return suite, {**how, "profile_file": profile_path} if how else how


def _save(run: EqualRun, results: dict, load_before: str, profile_path: str, how: dict) -> None:
    write_json(os.path.join(run.out, "runs.json"), {
        "suite": run.suite.name, "cpus": run.cpus, "load_before": load_before, "profile_file": profile_path,
        "sweep_rates": how,
        "results": {name: {**r, "runs": {n: records_json(rs) for n, rs in r["runs"].items()}}
                    for name, r in results.items()}})


def _saved(run: EqualRun) -> dict:
    """What an earlier run of the same suite on the same cores saved in out/runs.json ({} if none)."""
    path = os.path.join(run.out, "runs.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if doc["suite"] != run.suite.name or doc["cpus"] != run.cpus:
        raise ValueError(f"{path} holds suite {doc['suite']!r} on cores {doc['cpus']}, not {run.suite.name!r} on "
                         f"{run.cpus}: use another --out, or run without --resume")
    return doc


def _records_of(saved: dict) -> dict:
    return {**saved, "runs": {n: [RequestRecord(**r) for r in rs] for n, rs in saved["runs"].items()}}
