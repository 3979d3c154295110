"""The hardware profile: how long our passes take on some hardware, as a versioned JSON document.

A profile (`"format": "tandem-profile/1"`) is measured by `tandem profile` or written by hand from
published figures. Its parts:
- `hardware`: free-form facts (device, cores, memory, ...), shown in reports only.
- `model`: name, parameter count, KV bytes per token (what a handoff moves per prompt token).
- `serving`: the scheduler settings the simulated workers use (pass budget, page size, batch caps,
  KV pool bytes per device).
- `prefill`: pass time as a function of the pass's prompt tokens and sequences. `points` are
  measurements `(tokens, sequences, seconds)` of passes of `sequences` equal-length prompts;
  `fit` is the model the simulator uses:
      t = intercept_s + per_token_s * T + per_attention_s * A + per_sequence_s * S
  with T the tokens in the pass, S its sequences and A its causal-attention work in token pairs:
  sum over chunks of (start + n)^2 - start^2, i.e. len^2 for a whole prompt, and a long prompt's
  chunks add up to its len^2. For a measured point of S prompts of T/S tokens, A = T^2 / S.
- `decode`: step time as a function of batch size B and context tokens C (summed over the batch):
      t = intercept_s + per_sequence_s * B + per_context_token_s * C + per_log2_batch_s * log2(B)
  with `points` `(batch, context_tokens, seconds)`. The log term is for CPUs, where going from one
  sequence to a few turns matrix-vector products into slower-per-call matrix-matrix ones (it halves
  the fit error of our measured CPU profile); it is 0 in GPU profiles.
  Either part may give only `points` (the fit is made when the profile is read: non-negative
  least squares on relative error, see fit.py; no interpolation between points), only `fit` (a
  hand-written profile), or both (the fit is used; the points document where it came from).
- `scaling`: speedup of ONE worker spread over N devices relative to one device, per phase, e.g.
  `{"prefill": {"2": 1.7}, "decode": {"2": 1.4}}`. Nothing is assumed: a layout that needs a speedup
  the profile does not give (by value, or by interpolating between given N) is skipped.
- `handoff`: KV transfer throughput (GB/s = 10^9 bytes/s, bytes, not bits) and latency.
- `frontdoor`: latency the orchestrator's front door adds to the first token and to every token.
- `served` (optional): what serving adds to a token-streaming worker's step (planner/served.py).
- `sources`: where each input came from; `measured`: the command and date of a measured profile.
"""

from __future__ import annotations

import json
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.fit import nonnegative_fit
from planner.served import Served

FORMAT = "tandem-profile/1"


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file, the field and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelInfo(_Strict):
    name: str = Field(min_length=1)
    params: int = Field(gt=0, description="parameter count")
    kv_bytes_per_token: int = Field(gt=0, description="K and V of all layers for one token")
    num_layers: int | None = Field(None, gt=0)
    dtype: str | None = None
    weight_bytes: int | None = Field(None, gt=0, description="bytes a decode step reads in weights")


class Serving(_Strict):
    pass_tokens: int = Field(gt=0, description="prefill pass budget in tokens (512 on CPU, 8192 on GPU)")
    chunk_tokens: int = Field(256, gt=0, description="prompt tokens mixed into each chunked-prefill step")
    tokens_per_page: int = Field(16, gt=0)
    decode_max_batch: int = Field(256, gt=0)
    colocated_max_batch: int = Field(256, gt=0)
    kv_pool_bytes: int = Field(gt=0, description="KV pool of one decode worker / co-located replica per device")


class PrefillPoint(_Strict):
    tokens: int = Field(gt=0)
    sequences: int = Field(1, gt=0)
    seconds: float = Field(gt=0)

    @model_validator(mode="after")
    def _shape(self) -> "PrefillPoint":
        if self.sequences > self.tokens:
            raise ValueError(f"a pass of {self.tokens} tokens cannot hold {self.sequences} sequences")
        return self


class PrefillFit(_Strict):
    intercept_s: float = Field(ge=0)
    per_token_s: float = Field(ge=0)
    per_attention_s: float = Field(0.0, ge=0, description="per token pair of causal attention")
    per_sequence_s: float = Field(0.0, ge=0)


class DecodePoint(_Strict):
    batch: int = Field(gt=0)
    context_tokens: int = Field(gt=0, description="context tokens summed over the batch")
    seconds: float = Field(gt=0)


class DecodeFit(_Strict):
    intercept_s: float = Field(ge=0)
    per_sequence_s: float = Field(0.0, ge=0)
    per_context_token_s: float = Field(0.0, ge=0)
    per_log2_batch_s: float = Field(0.0, ge=0)


class FitError(_Strict):
    max_rel: float = Field(ge=0)
    mean_rel: float = Field(ge=0)


class Prefill(_Strict):
    points: tuple[PrefillPoint, ...] = ()
    fit: PrefillFit | None = None
    fit_error: FitError | None = None
    how: str = ""

    @model_validator(mode="after")
    def _something(self) -> "Prefill":
        if not self.points and self.fit is None:
            raise ValueError("give measured 'points', a 'fit', or both")
        return self


class Decode(_Strict):
    points: tuple[DecodePoint, ...] = ()
    fit: DecodeFit | None = None
    fit_error: FitError | None = None
    how: str = ""

    @model_validator(mode="after")
    def _something(self) -> "Decode":
        if not self.points and self.fit is None:
            raise ValueError("give measured 'points', a 'fit', or both")
        return self


class Scaling(_Strict):
    prefill: dict[int, float] = Field(default_factory=dict)
    decode: dict[int, float] = Field(default_factory=dict)
    how: str = ""

    @model_validator(mode="after")
    def _positive(self) -> "Scaling":
        for phase, table in (("prefill", self.prefill), ("decode", self.decode)):
            for n, s in table.items():
                if n < 1 or s <= 0:
                    raise ValueError(f"{phase}: device counts must be >= 1 and speedups > 0, got {n}: {s}")
        return self


class Handoff(_Strict):
    gbytes_per_s: float = Field(gt=0, description="GB/s, 10^9 bytes per second")
    latency_s: float = Field(0.0, ge=0)
    how: str = ""


class FrontDoor(_Strict):
    ttft_s: float = Field(ge=0)
    per_token_s: float = Field(ge=0)
    how: str = ""


class Source(_Strict):
    what: str = Field(min_length=1)
    citation: str = Field(min_length=1)


class Measured(_Strict):
    command: str
    date: str


class Profile(_Strict):
    format: Literal["tandem-profile/1"]
    name: str = Field(min_length=1)
    hardware: dict[str, str | int | float | bool]
    model: ModelInfo
    serving: Serving
    prefill: Prefill
    decode: Decode
    scaling: Scaling = Field(default_factory=Scaling)
    handoff: Handoff
    frontdoor: FrontDoor
    served: Served | None = None
    sources: tuple[Source, ...] = ()
    measured: Measured | None = None
    notes: str = ""

    @model_validator(mode="after")
    def _device(self) -> "Profile":
        if "device" not in self.hardware:
            raise ValueError("hardware needs at least a 'device' entry (free text, e.g. 'NVIDIA H100 SXM')")
        return self


def fitted(profile: Profile) -> Profile:
    """The profile with a `fit` (and its `fit_error` on the points) for prefill and decode.

    A phase that already has a fit keeps it; only its error on the points (if any) is filled in.
    """
    pre, dec = profile.prefill, profile.decode
    if pre.points:
        x = [[1.0, p.tokens, p.tokens ** 2 / p.sequences, p.sequences] for p in pre.points]
        y = [p.seconds for p in pre.points]
        if pre.fit is None:
            r = nonnegative_fit(x, y)
            pre = pre.model_copy(update={"fit": PrefillFit(
                intercept_s=r.coefficients[0], per_token_s=r.coefficients[1],
                per_attention_s=r.coefficients[2], per_sequence_s=r.coefficients[3])})
        f = pre.fit
        pre = pre.model_copy(update={"fit_error": _error(
            [f.intercept_s, f.per_token_s, f.per_attention_s, f.per_sequence_s], x, y)})
    if dec.points:
        x = [[1.0, p.batch, p.context_tokens, math.log2(p.batch)] for p in dec.points]
        y = [p.seconds for p in dec.points]
        if dec.fit is None:
            r = nonnegative_fit(x, y)
            dec = dec.model_copy(update={"fit": DecodeFit(
                intercept_s=r.coefficients[0], per_sequence_s=r.coefficients[1],
                per_context_token_s=r.coefficients[2], per_log2_batch_s=r.coefficients[3])})
        f = dec.fit
        dec = dec.model_copy(update={"fit_error": _error(
            [f.intercept_s, f.per_sequence_s, f.per_context_token_s, f.per_log2_batch_s], x, y)})
    return profile.model_copy(update={"prefill": pre, "decode": dec})


def _error(coef: list[float], x: list[list[float]], y: list[float]) -> FitError:
    rel = [abs(sum(c * v for c, v in zip(coef, row)) - t) / t for row, t in zip(x, y)]
    return FitError(max_rel=max(rel), mean_rel=sum(rel) / len(rel))


def parse_profile(data: object, where: str = "profile") -> Profile:
    """Validate a profile document (a parsed JSON object) and fit it; ProfileError names the field."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: a profile is a JSON object, got {type(data).__name__}")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise ProfileError(f"{where}: 'format' must be {FORMAT!r}, got {fmt!r}; this version of tandem reads "
                           f"{FORMAT} profiles only")
    try:
        return fitted(Profile.model_validate(data))
    except ValidationError as e:
        raise ProfileError(f"{where} is not a valid {FORMAT} profile:\n" + _describe(e)) from None


def load_profile(path: str) -> Profile:
    """Read and validate a profile file (JSON only: nothing in it is executed)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ProfileError(f"cannot read profile {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"profile {path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    return parse_profile(data, where=f"profile {path}")


def dump_profile(profile: Profile) -> str:
    """The profile as indented JSON (the format `load_profile` reads back)."""
    return profile.model_dump_json(indent=2, exclude_none=True) + "\n"


def _describe(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(err["loc"][:-1])
            msg = "unknown key" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def _allowed_keys(loc: tuple) -> list[str]:
    """The field names of the model at `loc` inside a Profile (empty if it is not a model)."""
    cls: type[BaseModel] | None = Profile
    for part in loc:
        if cls is None or isinstance(part, int):
            continue  # an index into a tuple of models keeps the element model
        field = cls.model_fields.get(str(part))
        cls = _model_of(field.annotation) if field is not None else None
    return sorted(cls.model_fields) if cls is not None else []


def _model_of(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        m = _model_of(arg)
        if m is not None:
            return m
    return None
