"""Triton's schedule-policy extension on the KServe doors (Triton gRPC and KServe v2 HTTP alike).

A request's parameters may carry, as on Triton:
- `priority`: a priority level, 1 the highest, then 2, ...; 0 (or none) is the model's default level.
  Levels map onto Tandem's priority (vLLM's: lower first, 0 the default, control/requests.py) with the
  default level in the middle: level k is priority k - DEFAULT_LEVEL, so level 1 goes before every
  unmarked request and level 2^32-1 after them, and an OpenAI request's `priority` p is level
  p + DEFAULT_LEVEL. The served model's config says so (`dynamic_batching.priority_levels`,
  `default_priority_level`) when the server honours priorities (`--scheduling-policy priority`);
  without it any level but 0 is refused, as the OpenAI doors refuse a priority.
- `timeout`: microseconds the request may take (0: no limit of its own); the earlier of it and the
  call's own deadline (gRPC deadline, `Tandem-Timeout` header) ends it with DEADLINE_EXCEEDED.
Anything else of the wrong type or out of range is refused, naming the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.status import InvalidArgument

LEVELS = 2**32 - 1  # levels 1..LEVELS: Tandem's priorities [-2^31 + 1, 2^31 - 1]
DEFAULT_LEVEL = 2**31  # Tandem's priority 0


@dataclass(frozen=True)
class Schedule:
    priority: int = 0  # Tandem's (lower first)
    timeout_s: float | None = None


def schedule_of(parameters) -> Schedule:
    """The schedule a request's parameters ask for (`parameters`: name -> plain value)."""
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"parameters must be an object of name: value, got {type(parameters).__name__}",
                              "parameters")
    level = _integer(parameters, "priority", LEVELS, "a priority level: 1 the highest, 0 the model's default")
    us = _integer(parameters, "timeout", 2**63 - 1, "microseconds, 0 for none")
    return Schedule(level - DEFAULT_LEVEL if level else 0, us / 1e6 if us else None)


def grpc_parameters(parameters) -> dict:
    """A gRPC request's `parameters` map (name -> InferParameter) as plain values."""
    return {name: getattr(p, p.WhichOneof("parameter_choice")) for name, p in parameters.items()
            if p.WhichOneof("parameter_choice") is not None}


def advertise(dynamic_batching) -> None:
    """Say, in the served model's config, how levels are read (Triton's priority_levels fields)."""
    dynamic_batching.priority_levels, dynamic_batching.default_priority_level = LEVELS, DEFAULT_LEVEL


def _integer(parameters: dict, name: str, most: int, what: str) -> int:
    value = parameters.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise InvalidArgument(f"parameter {name} must be an integer in [0, {most}] ({what}), got {value!r:.40}",
                              name)
    return value
