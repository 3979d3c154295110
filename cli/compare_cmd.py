"""`tandem bench compare`'s arguments checked and dispatched: a scenario comparison (compare.py) or a
whole suite (equal.py). Bad arguments end in a click error naming the allowed values."""

from __future__ import annotations

import os
import shlex
import sys

import click

from clients.bench.bench_layouts import LayoutError, parse_layouts
from clients.bench.bench_workload import SCENARIOS


def parse_cores(text: str | None) -> list[int]:
    """`0,1` or `0-3` (or None: every core this process may use) -> sorted core ids, each available."""
    allowed = sorted(os.sched_getaffinity(0))
    if text is None:
        return allowed
    out: set[int] = set()
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise click.BadParameter(f"{text!r}: give cores like 0,1 or 0-3", param_hint="--cores") from None
    missing = sorted(out - set(allowed))
    if not out or missing:
        raise click.BadParameter(f"{text!r}: cores {missing or 'none'} are not available; this process may use "
                                 f"{allowed}", param_hint="--cores")
    return sorted(out)


def run_from_cli(*, engines, suite, scenarios, layouts, cores, protocol, out, slo, kv_pool_bytes, chunk_tokens,
                 profile, handoff_gbps, note, resume, tokenizer) -> None:
    cpus = parse_cores(cores)
    try:
        chosen = parse_layouts(layouts, len(cpus))
    except LayoutError as e:
        raise click.BadParameter(str(e), param_hint="--layouts") from None
    log = lambda m: click.echo(m, err=True)  # noqa: E731
    command = "tandem " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if suite:
        from clients.bench.equal import EqualRun, run_equal_hardware
        from clients.bench.suite import SUITES

        run = EqualRun(SUITES[suite], chosen, cpus, out, engines, protocol, kv_pool_bytes, chunk_tokens, profile,
                       handoff_gbps, note, command, resume)
        try:
            doc = run_equal_hardware(run, tokenizer, log)
        except ValueError as e:  # a saved run of another suite, a profile that cannot be read
            raise click.ClickException(str(e)) from None
        v = doc["validation_summary"]
        click.echo(f"report: {os.path.join(out, 'report.md')}; validation targets met: TTFT {v['ttft_p50_rel']}/"
                   f"{v['rows']}, ITL {v['itl_p50_rel']}/{v['rows']}, attainment {v['attainment_points']}/{v['rows']}")
        return
    from clients.bench.compare import run_compare
    from clients.bench.suite import settings_for

    names = [s.strip() for s in scenarios.split(",") if s.strip()]
    bad = [s for s in names if s not in SCENARIOS]
    if bad or not names:
        raise click.BadParameter(f"unknown scenarios {bad}; allowed: {sorted(SCENARIOS)}", param_hint="--scenarios")
    settings = settings_for([SCENARIOS[n] for n in names], engines, kv_pool_bytes, chunk_tokens)
    doc = run_compare(out, names, chosen, cpus, protocol, slo[0], slo[1], settings, tokenizer, log)
    with open(os.path.join(out, "report.md")) as f:
        click.echo(f.read())
    click.echo(f"report: {os.path.join(out, 'report.md')} ({len(doc['scenarios'])} scenarios)")
