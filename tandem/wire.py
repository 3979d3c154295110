"""Control messages between the orchestrator and the workers: JSON objects, never pickle.

Every message is a frozen dataclass; `parse` rejects unknown or missing keys and wrong types, so a
malformed message from a peer becomes a clear WireError instead of a crash deeper in.

The decode model takes one `request` tensor holding a JSON object with an `op`:
  reserve  -> Reservation          (pages leased for a prompt; the lease expires unless committed)
  generate -> a stream of tokens   (commits the lease; pages must have been written by prefill)
  release  -> {"released": bool}  (cancel; frees the pages whatever state they are in)
  stats    -> WorkerStats
The prefill model takes `input_ids` plus a `request` tensor holding a PrefillRequest.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass


class WireError(ValueError):
    """A control message is malformed. The message names the field and what was expected."""


def parse(cls, data):
    """Build dataclass `cls` from a JSON object (dict or bytes/str), checking keys and value types."""
    if isinstance(data, (bytes, str)):
        try:
            data = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WireError(f"{cls.__name__}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise WireError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise WireError(f"{cls.__name__}: unknown fields {sorted(unknown)}; allowed: {sorted(known)}")
    kwargs = {}
    for name, f in known.items():
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise WireError(f"{cls.__name__}: missing field {name!r}")
            continue
        kwargs[name] = _check(cls.__name__, name, data[name], hints[name])
    return cls(**kwargs)


def _check(owner: str, name: str, value, hint):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if is_dataclass(hint):
        return parse(hint, value)
    if origin is list:
        if not isinstance(value, list):
            raise WireError(f"{owner}.{name}: expected a list, got {type(value).__name__}")
        return [_check(owner, name, v, args[0]) for v in value]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{owner}.{name}: expected an object, got {type(value).__name__}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (not isinstance(value, hint) or (hint is int and isinstance(value, bool))):
        raise WireError(f"{owner}.{name}: expected {hint.__name__}, got {type(value).__name__}")
    return value


def dump(msg) -> bytes:
    return json.dumps(asdict(msg), separators=(",", ":")).encode()


@dataclass(frozen=True)
class Destination:
    """Where a prefill worker writes a request's K/V: pages leased in a decode worker's pool."""

    pool: dict  # the decode pool's transport descriptor (see engine/transports); holds access keys
    page_ids: list[int]
    lease: str


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    sampling: dict  # engine.sampling.SamplingParams fields
    destination: Destination | None = None  # None: compute the first token only (no handoff)
    output_ids: list[int] = field(default_factory=list)  # tokens already streamed (recovery re-prefill)


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    token: int
    logprob: float | None
    finish_reason: str | None  # set when the first token already ends the request
    kv_bytes: int
    kv_seconds: float  # time spent waiting for the handoff after compute
    prefill_seconds: float


@dataclass(frozen=True)
class DecodeOp:
    op: str  # reserve | generate | release | stats
    request_id: str = ""
    num_tokens: int = 0  # reserve: prompt (+ already generated) tokens whose pages prefill will write
    max_tokens: int = 0  # reserve: tokens still to generate (pages are reserved for them too)
    lease_ms: int = 0  # reserve: 0 = the worker's default lease
    lease: str = ""  # generate / release: the token reserve returned
    prompt_ids: list[int] = field(default_factory=list)  # generate
    output_ids: list[int] = field(default_factory=list)  # generate: tokens produced so far (>= 1)
    sampling: dict = field(default_factory=dict)  # generate


@dataclass(frozen=True)
class Reservation:
    request_id: str
    lease: str
    page_ids: list[int]
    expires_in_ms: int
    pool: dict  # transport descriptor of this worker's pool


@dataclass(frozen=True)
class WorkerStats:
    role: str
    pages_total: int = 0
    pages_used: int = 0
    running: int = 0
    leased: int = 0
    waiting_for_pages: int = 0
    kv_bytes_received: int = 0
