"""Simulated workloads: prompt and output length distributions, and how requests arrive.

Lengths (tokens, integers >= 1) are drawn from one of:
- `fixed` (value), `uniform` (low..high, inclusive), `normal` (mean, std, rounded and clipped to
  low..high), `empirical` (values, drawn uniformly with replacement: e.g. lengths from a trace).
Arrivals are either `poisson` (a rate in requests/s: an open loop, arrivals do not wait for answers)
or `closed` (`concurrency` clients, each sending its next request the moment its last one finished).
Priorities (optional): classes of requests, each a priority (lower is served first, as `priority` in a
request with `--scheduling-policy priority`) and a weight; each request draws its class. A class may
have prompt or output lengths of its own (short interactive turns beside long batch jobs). None: every
request has priority 0 (first come, first served).

On the command line a length is written `512`, `uniform:128:1024`, `normal:512:128` (clipped to
1..), `normal:512:128:64:2048`, `list:100,200,300` or `file:PATH` (a JSON list of integers, or one
integer per line). Priorities are written `PRIORITY:WEIGHT,...`, e.g. `0:1,1:4` (a fifth at priority 0);
a class's own lengths `PRIORITY=LENGTH`, e.g. `0=128` (see with_class_lengths).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.sampling_params import MAX_PRIORITY


class WorkloadError(ValueError):
    """A workload that cannot be drawn; the message says what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Fixed(_Strict):
    kind: Literal["fixed"] = "fixed"
    value: int = Field(ge=1)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


class Uniform(_Strict):
    kind: Literal["uniform"] = "uniform"
    low: int = Field(ge=1)
    high: int = Field(ge=1)

    @model_validator(mode="after")
    def _order(self) -> "Uniform":
        if self.high < self.low:
            raise ValueError(f"uniform needs low <= high, got {self.low} > {self.high}")
        return self

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n)


class Normal(_Strict):
    kind: Literal["normal"] = "normal"
    mean: float = Field(gt=0)
    std: float = Field(ge=0)
    low: int = Field(1, ge=1)
    high: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _order(self) -> "Normal":
        if self.high is not None and self.high < self.low:
            raise ValueError(f"normal needs low <= high, got {self.low} > {self.high}")
        return self

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = np.rint(rng.normal(self.mean, self.std, size=n))
        return np.clip(x, self.low, self.high if self.high is not None else np.inf).astype(np.int64)


class Empirical(_Strict):
    kind: Literal["empirical"] = "empirical"
    values: tuple[Annotated[int, Field(ge=1)], ...] = Field(min_length=1)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=n, replace=True)


Length = Annotated[Union[Fixed, Uniform, Normal, Empirical], Field(discriminator="kind")]


class Poisson(_Strict):
    kind: Literal["poisson"] = "poisson"
    rate: float = Field(gt=0, description="requests per second")


class ClosedLoop(_Strict):
    kind: Literal["closed"] = "closed"
    concurrency: int = Field(ge=1)


Arrivals = Annotated[Union[Poisson, ClosedLoop], Field(discriminator="kind")]


class Share(_Strict):
    """One priority class: its priority (lower goes first), its weight among the classes, and its own
    prompt or output lengths (None: the workload's)."""
    priority: int = Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    weight: float = Field(gt=0, allow_inf_nan=False)
    prompt: Length | None = None
    output: Length | None = None


class Workload(_Strict):
    prompt: Length
    output: Length
    arrivals: Arrivals
    requests: int = Field(ge=1)
    seed: int = 0
    priorities: tuple[Share, ...] = ()  # empty: every request priority 0

    @model_validator(mode="after")
    def _classes(self) -> "Workload":
        _distinct(self.priorities)
        return self

    def with_arrivals(self, arrivals: Poisson | ClosedLoop) -> "Workload":
        return self.model_copy(update={"arrivals": arrivals})


@dataclass(frozen=True)
class RequestSpec:
    prompt_len: int
    output_len: int
    arrival: float | None  # seconds after the start (Poisson); None: sent by a closed-loop client
    priority: int = 0


def draw(workload: Workload) -> list[RequestSpec]:
    """The workload's requests, the same for the same seed (whatever layout simulates them). Classes are
    drawn last: a workload with priorities has the arrival times of the same one without, and the lengths
    too, except where a class has its own (drawn after the classes, class by class in the given order)."""
    rng = np.random.default_rng(workload.seed)
    n = workload.requests
    prompts = workload.prompt.draw(rng, n)
    outputs = workload.output.draw(rng, n)
    times = (np.cumsum(rng.exponential(1.0 / workload.arrivals.rate, size=n))
             if isinstance(workload.arrivals, Poisson) else [None] * n)
    shares = workload.priorities
    classes = np.zeros(n, dtype=np.int64)
    if shares:
        weights = np.array([s.weight for s in shares], dtype=np.float64)
        picked = rng.choice(len(shares), size=n, p=weights / weights.sum())  # [n] index into shares
        classes = np.array([s.priority for s in shares], dtype=np.int64)[picked]
        for i, share in enumerate(shares):
            mine = picked == i  # [n] bool
            for own, lengths in ((share.prompt, prompts), (share.output, outputs)):
                if own is not None:
                    lengths[mine] = own.draw(rng, int(mine.sum()))
    return [RequestSpec(int(p), int(o), None if t is None else float(t), int(c))
            for p, o, t, c in zip(prompts, outputs, times, classes)]


def parse_priorities(text: str) -> tuple[Share, ...]:
    """Priority classes from their command-line form `PRIORITY:WEIGHT,...` (see the module docstring)."""
    try:
        shares = tuple(_share(part.strip()) for part in text.split(","))
        return _distinct(shares)
    except ValueError as e:  # int()/float() failures and pydantic's ValidationError (a ValueError)
        raise WorkloadError(f"bad priorities {text!r}: {_first_line(e)}; {PRIORITIES_HELP}") from None


def _share(text: str) -> Share:
    priority, sep, weight = text.partition(":")
    if not sep:
        raise ValueError(f"{text!r} has no weight")
    return Share(priority=int(priority), weight=float(weight))


def with_class_lengths(shares: tuple[Share, ...], prompts: tuple[str, ...] = (),
                       outputs: tuple[str, ...] = ()) -> tuple[Share, ...]:
    """`shares` with the lengths given for some classes, each `PRIORITY=LENGTH` (a length as
    parse_length takes it), e.g. `0=128` or `1=uniform:512:2048`; a class given twice, or a priority that
    is not a class, is refused."""
    by_priority = {s.priority: s for s in shares}
    for field, given in (("prompt", prompts), ("output", outputs)):
        seen = set()
        for text in given:
            priority, sep, length = text.partition("=")
            try:
                p = int(priority)
            except ValueError:
                p = None
            if not sep or p is None:
                raise WorkloadError(f"bad class {field} length {text!r}: write PRIORITY=LENGTH, e.g. 0=128")
            if p not in by_priority:
                raise WorkloadError(f"bad class {field} length {text!r}: priority {p} is not one of the classes "
                                    f"({', '.join(str(q) for q in sorted(by_priority)) or 'none given'})")
            if p in seen:
                raise WorkloadError(f"bad class {field} length {text!r}: priority {p} is given twice")
            seen.add(p)
            by_priority[p] = by_priority[p].model_copy(update={field: parse_length(length)})
    return tuple(by_priority[s.priority] for s in shares)


def _distinct(shares: tuple[Share, ...]) -> tuple[Share, ...]:
    if len({s.priority for s in shares}) < len(shares):
        raise ValueError("each priority may be given once")
    return shares


PRIORITIES_HELP = ("write priority classes as PRIORITY:WEIGHT,... (integers, lower served first; weights > 0), "
                   "e.g. 0:1,1:4")


def parse_length(text: str) -> Fixed | Uniform | Normal | Empirical:
    """A length distribution from its command-line form (see the module docstring)."""
    kind, _, rest = text.partition(":")
    try:
        if not rest:
            return Fixed(value=int(kind))
        if kind == "uniform":
            lo, hi = rest.split(":")
            return Uniform(low=int(lo), high=int(hi))
        if kind == "normal":
            parts = [float(x) for x in rest.split(":")]
            if len(parts) not in (2, 4):
                raise ValueError("normal takes mean:std or mean:std:low:high")
            extra = {"low": int(parts[2]), "high": int(parts[3])} if len(parts) == 4 else {}
            return Normal(mean=parts[0], std=parts[1], **extra)
        if kind == "list":
            return Empirical(values=tuple(int(x) for x in rest.split(",")))
        if kind == "file":
            return Empirical(values=tuple(_read_lengths(rest)))
    except ValueError as e:  # int() failures and pydantic's ValidationError (a ValueError)
        raise WorkloadError(f"bad length {text!r}: {_first_line(e)}; {LENGTH_HELP}") from None
    raise WorkloadError(f"bad length {text!r}: unknown kind {kind!r}; {LENGTH_HELP}")


LENGTH_HELP = ("write a length as N, uniform:LOW:HIGH, normal:MEAN:STD[:LOW:HIGH], list:A,B,C or file:PATH "
               "(a JSON list of integers or one integer per line)")


def _read_lengths(path: str) -> list[int]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            values = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a JSON list: {e.msg}") from None
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{path} must hold a JSON list of integers")
        return values
    return [int(line) for line in stripped.splitlines() if line.strip()]


def _first_line(e: Exception) -> str:
    msg = str(e)
    if hasattr(e, "errors"):
        errs = e.errors()
        if errs:
            msg = f"{'.'.join(str(p) for p in errs[0]['loc'])}: {errs[0]['msg']}" if errs[0]["loc"] else errs[0]["msg"]
    return msg.splitlines()[0]


def describe_length(d: Fixed | Uniform | Normal | Empirical) -> str:
    """A short human form of a length distribution, for reports."""
    if isinstance(d, Fixed):
        return str(d.value)
    if isinstance(d, Uniform):
        return f"uniform {d.low}..{d.high}"
    if isinstance(d, Normal):
        hi = "" if d.high is None else f"..{d.high}"
        return f"normal(mean {d.mean:g}, std {d.std:g}) clipped to {d.low}{hi or '..'}"
    return f"empirical ({len(d.values)} values, mean {sum(d.values) / len(d.values):.0f})"


def describe_priorities(shares: tuple[Share, ...]) -> str:
    """The classes' shares of requests (and lengths of their own), for reports."""
    total = sum(s.weight for s in shares)
    return ", ".join(f"priority {s.priority}: {s.weight / total:.0%}{_own_lengths(s)}"
                     for s in sorted(shares, key=lambda s: s.priority))


def _own_lengths(share: Share) -> str:
    own = [f"{name} {describe_length(d)}" for name, d in (("prompt", share.prompt), ("output", share.output))
           if d is not None]
    return f" ({', '.join(own)})" if own else ""
