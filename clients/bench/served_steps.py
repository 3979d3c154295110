"""`tandem profile --served`: measure what serving adds to a step (planner/served.py), through `tandem serve`.

For each worker shape the machine's cores allow, the layout that fills the cores with it is served
(suite.run_layout: pinned workers, a warm-up first):
- `colocated` on 1 device: `colocated Nx1`;
- `colocated` on N devices: `colocated 1xN` (when N > 1 and the profile gives its speedup);
- `decode` on 1 device: `1P(N-1)D` (when N > 1): every core but one streams tokens (the prefill core
  is idle while the bursts stream, so this is the overhead beside an idle prefill worker).
Each is sent bursts of B equal requests per token-streaming worker (every request at once, a short
prompt, a fixed answer), so each step holds B sequences. A point is the median gap between a stream's
tokens away from its first and last `EDGE` tokens (prefill passes and the burst's ragged end), with the
context mid-stream; its `predicted_s` is the step the profile predicts without serving plus the front
door's per-token figure. The fit per shape is planner.served.fit_overhead of its points.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from dataclasses import dataclass

from clients.bench.bench_workload import Scenario, Stream
from clients.bench.suite import run_layout, settings_for
from planner.costs import PassCosts
from planner.profile import Profile
from planner.served import Served, ServedFit, ServedPoint, fit_overhead
from planner.sim.sim_layouts import Layout, speedup

EDGE = 8  # gaps left out at each end of a stream


@dataclass(frozen=True)
class ServedOptions:
    model: str  # what `tandem serve` serves: the profile's model (a name, a file, or an engines folder)
    cpus: tuple[int, ...]  # the cores to serve on (the profile's devices)
    batches: tuple[int, ...] = (1, 4, 16)  # sequences per worker in each burst
    prompt_len: int = 32
    output_len: int = 64  # > 2 * EDGE
    kv_pool_bytes: int = 256 << 20  # per KV-owning worker; the largest burst holds 16 x 96 tokens per worker
    protocol: str = "grpc"

    def __post_init__(self):
        if self.output_len <= 2 * EDGE + 1:
            raise ValueError(f"output_len must be > {2 * EDGE + 1} (the gaps measured leave out {EDGE} at each end)")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be >= 1, got {self.batches}")


def shapes(profile: Profile, cores: int) -> list[tuple[str, int, Layout]]:
    """(role, devices per worker, the layout served to measure it) for `cores` cores."""
    out = [("colocated", 1, Layout("colocated", cores))]
    if cores > 1:
        if speedup(profile, "decode", cores) is not None and speedup(profile, "prefill", cores) is not None:
            out.append(("colocated", cores, Layout("colocated", 1, devices_per_worker=cores)))
        out.append(("decode", 1, Layout("disaggregated", 1, cores - 1)))
    return out


def measure_served(profile: Profile, opts: ServedOptions, tokenizer, log=print) -> Served:
    """Serve every shape in turn and return the `served` part of the profile (fits and their points)."""
    points: list[ServedPoint] = []
    fits: list[ServedFit] = []
    work = tempfile.mkdtemp(prefix="tandem-served-")
    try:
        for role, devices, layout in shapes(profile, len(opts.cpus)):
            streaming = layout.decode_workers or layout.workers
            scenarios = [_burst(b, streaming, opts) for b in opts.batches]
            settings = settings_for(scenarios, opts.model, opts.kv_pool_bytes, 256)
            runs = run_layout(scenarios, layout, list(opts.cpus), settings, opts.protocol, tokenizer, work, log)["runs"]
            costs = PassCosts.of(profile, speedup(profile, "prefill", devices), speedup(profile, "decode", devices))
            mine = [_point(role, devices, b, runs[f"burst-{b}"], costs, profile) for b in opts.batches]
            fit = fit_overhead(mine)
            log(f"[{layout.name}] {role} on {devices} device(s): +{fit.per_step_s * 1e3:.2f} ms per step, "
                f"+{fit.per_sequence_s * 1e3:.2f} ms per sequence "
                + ", ".join(f"(B={p.batch}: {p.seconds * 1e3:.1f} ms served, {p.predicted_s * 1e3:.1f} ms predicted)"
                            for p in mine))
            points += mine
            fits.append(ServedFit(role=role, devices=devices, per_step_s=fit.per_step_s,
                                  per_sequence_s=fit.per_sequence_s))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Served(fits=tuple(fits), points=tuple(points), how=(
        f"tandem serve on cores {list(opts.cpus)} over {opts.protocol}: bursts of {', '.join(map(str, opts.batches))} "
        f"requests per streaming worker ({opts.prompt_len}-token prompts, {opts.output_len}-token answers); "
        f"median gap between tokens {EDGE + 1}..{opts.output_len - EDGE} against the unserved step "
        f"(clients/bench/served_steps.py)"))


def _burst(batch: int, workers: int, opts: ServedOptions) -> Scenario:
    n = batch * workers
    return Scenario(f"burst-{batch}", (Stream(f"burst-{batch}", opts.prompt_len, opts.output_len, count=n,
                                              concurrency=n),), warmup=0, seed=500 + batch,
                    description=f"{n} requests at once: {batch} per streaming worker")


def _point(role: str, devices: int, batch: int, records, costs: PassCosts, profile: Profile) -> ServedPoint:
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of the burst's {len(records)} requests failed; first: {failed[0]}")
    short = [r.output_tokens for r in records if r.output_tokens < 2 * EDGE + 2]
    if short:
        raise RuntimeError(f"answers of {short} tokens: too short to measure (ended early?)")
    gaps = [g for r in records for g in r.gaps[EDGE:-EDGE]]
    prompt = statistics.mean(r.prompt_tokens for r in records)
    answer = statistics.mean(r.output_tokens for r in records)
    context = max(1, round(batch * (prompt + answer / 2)))
    return ServedPoint(role=role, devices=devices, batch=batch, context_tokens=context,
                       seconds=statistics.median(gaps),
                       predicted_s=costs.decode_time(batch, context) + profile.frontdoor.per_token_s)
