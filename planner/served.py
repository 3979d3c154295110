"""What serving adds to a worker's step, beyond the engine's pass: a profile's optional `served` part.

A served worker's step costs more than the pass `tandem profile` times alone: every sequence's token
leaves as a Triton decoupled response through the Python backend stub's IPC, the orchestrator and the
front door forward it, and on a CPU all of that shares the cores with the workers (a worker of several
threads also waits for its slowest thread). `tandem profile --served` measures it through
`tandem serve` (clients/bench/served_steps.py): bursts of B equal requests per worker, each stream's
median gap between tokens against the step the profile predicts for that batch and context.

The simulator charges `per_step_s + per_sequence_s * S` to every step of a worker that streams
tokens, S being the sequences the step answers: a decode worker's step (S = batch), and each pass of
a co-located worker (prefill, decode or chunked: S = the sequences in it). A disaggregated prefill
worker's pass is charged nothing: it streams no tokens.

Overheads are kept per (role, devices per worker): `decode` (a disaggregated decode worker) or
`colocated` (a co-located worker, with or without chunked prefill). A shape the profile does not give
takes the same role's nearest measured device count (the lower on a tie); a role not measured at all
is charged nothing, as before this part existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ROLES = ("decode", "colocated")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServedPoint(_Strict):
    role: Literal["decode", "colocated"]
    devices: int = Field(1, gt=0, description="devices (CPU: cores) per worker")
    batch: int = Field(gt=0, description="sequences in each step")
    context_tokens: int = Field(gt=0, description="context tokens summed over the batch, mid-stream")
    seconds: float = Field(gt=0, description="median gap between a stream's tokens, as a client saw it")
    predicted_s: float = Field(gt=0, description="the step plus the front door's per-token figure, unserved")


class ServedFit(_Strict):
    role: Literal["decode", "colocated"]
    devices: int = Field(1, gt=0)
    per_step_s: float = Field(ge=0)
    per_sequence_s: float = Field(ge=0)


class Served(_Strict):
    fits: tuple[ServedFit, ...]
    points: tuple[ServedPoint, ...] = ()
    how: str = ""

    @model_validator(mode="after")
    def _one_fit_per_shape(self) -> "Served":
        keys = [(f.role, f.devices) for f in self.fits]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"one fit per (role, devices); given more than once: {twice}")
        return self


@dataclass(frozen=True)
class StepOverhead:
    """Seconds a served step costs beyond the engine's pass: per_step_s + per_sequence_s * sequences."""

    per_step_s: float = 0.0
    per_sequence_s: float = 0.0

    def __call__(self, sequences: int) -> float:
        return self.per_step_s + self.per_sequence_s * sequences


NONE = StepOverhead()


def overhead(served: Served | None, role: str, devices: int) -> StepOverhead:
    """The overhead a `role` worker on `devices` devices pays per step (see the module's fallback rule)."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} unknown; allowed: {', '.join(ROLES)}")
    fits = [f for f in (served.fits if served else ()) if f.role == role]
    if not fits:
        return NONE
    best = min(fits, key=lambda f: (abs(f.devices - devices), f.devices))
    return StepOverhead(best.per_step_s, best.per_sequence_s)


def fit_overhead(points: Sequence[ServedPoint]) -> StepOverhead:
    """Least squares of `seconds - predicted_s` on `per_step_s + per_sequence_s * batch`, both >= 0.

    With both free the answer is the ordinary fit; when that puts one coefficient below zero, the best
    fit with it at zero is taken (the other alone), and a negative result there is 0: serving never
    makes a step faster in this model.
    """
    if not points:
        raise ValueError("no served points to fit")
    xs = [float(p.batch) for p in points]
    ys = [p.seconds - p.predicted_s for p in points]
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    det = n * sxx - sx * sx
    if det > 0:
        slope = (n * sxy - sx * sy) / det
        step = (sy - slope * sx) / n
        if slope >= 0 and step >= 0:
            return StepOverhead(step, slope)
    only_step = StepOverhead(max(0.0, sy / n), 0.0)
    only_seq = StepOverhead(0.0, max(0.0, sxy / sxx))
    return min((only_step, only_seq), key=lambda o: sum((o(int(x)) - y) ** 2 for x, y in zip(xs, ys)))
