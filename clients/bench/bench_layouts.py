"""Serving layouts on equal hardware: the same cores split into prefill and decode workers (xPyD),
into co-located replicas (Nx1), or given to one co-located worker (1xN), with or without chunked
prefill. Names are the planner's (planner/sim/sim_layouts.py), so measured and simulated runs pair up.

A layout becomes a deployment file for `tandem serve --config`: the mode, the worker counts, the KV
pool per worker and limits that do not refuse the benchmark's own load. `tandem serve` pins each
worker to its share of the cores it is given (ops/local_workers.py, plan_cpus); `check_pinning`
verifies that share in the serve workdir's workers.json.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import yaml

from ops.deployment import Deployment
from ops.local_workers import plan_cpus
from planner.sim.sim_layouts import Layout


class LayoutError(ValueError):
    """A layout that cannot be served on equal hardware; the message says why."""


def equal_hardware_layouts(cores: int) -> list[Layout]:
    """Every layout of exactly `cores` single-core devices: xPyD splits, replicas and one worker."""
    if cores < 1:
        raise LayoutError(f"cores must be >= 1, got {cores}")
    out = [Layout("disaggregated", x, cores - x) for x in range(1, cores)]
    for kind in ("colocated", "chunked"):
        out.append(Layout(kind, cores))
        if cores > 1:
            out.append(Layout(kind, 1, devices_per_worker=cores))
    return out


def parse_layouts(text: str | None, cores: int) -> list[Layout]:
    """Comma-separated layout names (e.g. `1P1D,colocated 2x1`), each of exactly `cores` cores; None
    or empty: all of them."""
    every = {x.name: x for x in equal_hardware_layouts(cores)}
    if not text:
        return list(every.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in every]
    if bad:
        raise LayoutError(f"unknown layout(s) {bad} for {cores} cores; allowed: {', '.join(every)}")
    return [every[n] for n in names]


@dataclass(frozen=True)
class ServeSettings:
    model: str
    kv_pool_bytes: int  # per KV-owning worker (decode or co-located)
    chunk_tokens: int
    max_in_flight: int  # at least the most requests the benchmark ever has open at once
    max_queued_tokens: int
    request_timeout_s: float = 3600.0


def deployment(layout: Layout, settings: ServeSettings) -> dict:
    """The deployment document for `layout` (validated by the deployment schema)."""
    doc: dict = {"model": settings.model, "kv_pool_bytes": settings.kv_pool_bytes,
                 "limits": {"max_in_flight": settings.max_in_flight, "max_queued_tokens": settings.max_queued_tokens,
                            "request_timeout_s": settings.request_timeout_s}}
    if os.path.isfile(os.path.join(settings.model, "prefill", "manifest.json")):
        doc["engines"] = doc.pop("model")
    if layout.kind == "disaggregated":
        doc.update(mode="disaggregated", prefill={"count": layout.workers}, decode={"count": layout.decode_workers})
    else:
        doc.update(mode=layout.kind, replicas=layout.workers)
        if layout.kind == "chunked":
            doc["chunk_tokens"] = settings.chunk_tokens
    Deployment(**doc)  # refuse here, with the schema's message, what tandem serve would refuse later
    return doc


def write_deployment(path: str, layout: Layout, settings: ServeSettings) -> str:
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(deployment(layout, settings), f, sort_keys=False)
    return path


def worker_counts(layout: Layout) -> dict[str, int]:
    if layout.kind == "disaggregated":
        return {"prefill": layout.workers, "decode": layout.decode_workers}
    return {"generate": layout.workers}


def check_pinning(workers: dict, layout: Layout, cpus: list[int]) -> dict[str, list[int]]:
    """The cores of each worker in workers.json ({name: {"cpus": [...]}}), checked: the layout's
    workers, disjoint, together exactly `cpus`, and each the share plan_cpus gives it."""
    expected = {s.name: list(s.cpus) for s in plan_cpus(worker_counts(layout), cpus)}
    got = {name: sorted(w["cpus"]) for name, w in workers.items()}
    if set(got) != set(expected):
        raise LayoutError(f"{layout.name}: workers {sorted(got)} running, expected {sorted(expected)}")
    used = [c for cs in got.values() for c in cs]
    if len(used) != len(set(used)) or sorted(used) != sorted(cpus):
        raise LayoutError(f"{layout.name}: workers pinned to {got}, not disjoint shares of cores {cpus}")
    if got != expected:
        raise LayoutError(f"{layout.name}: workers pinned to {got}, expected {expected}")
    return got


@contextlib.contextmanager
def cores(cpus: list[int]):
    """Run the block with this process confined to `cpus`: processes started inside inherit it (a
    `tandem serve` then splits exactly these cores among its workers)."""
    before = os.sched_getaffinity(0)
    missing = set(cpus) - before
    if missing:
        raise LayoutError(f"cores {sorted(missing)} are not available to this process (it may use {sorted(before)})")
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
