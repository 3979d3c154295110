"""Triton's schedule-policy extension on the KServe doors (Triton gRPC and KServe v2 HTTP alike).

A request's parameters may carry, as on Triton:
- `priority`: a priority level, 1 the highest, then 2, ... up to the model's count of levels; 0 (or none)
  is the model's default level. Levels map onto Tandem's priority (vLLM's: lower first, 0 the default,
  control/requests.py) around the default level (`PriorityLevels`): level k is priority k - default, so an
  OpenAI request's `priority` p is level p + default. By default the levels are 2^32-1 with the default in
  the middle (level 1 goes before every unmarked request, level 2^32-1 after them); a deployment may set
  them as a Triton model's config does (`--priority-levels 3 --default-priority-level 2`: 1 high, 2 normal,
  3 low). The served model's config says so (`dynamic_batching.priority_levels`,
  `default_priority_level`) when the server honours priorities (`--scheduling-policy priority`);
  without it any level but the default is refused, as the OpenAI doors refuse a priority. A level above
  the count is refused (Triton reads it as the default level).
- `timeout`: microseconds the request may take (0: no limit of its own); the earlier of it and the
  call's own deadline (gRPC deadline, `Tandem-Timeout` header) ends it with DEADLINE_EXCEEDED.
Anything else of the wrong type or out of range is refused, naming the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.sampling_params import MAX_PRIORITY
from tandem.status import InvalidArgument

LEVELS = 2**32 - 1  # the most levels: 1..LEVELS are Tandem's priorities [-2^31 + 1, 2^31 - 1]
DEFAULT_LEVEL = 2**31  # their default level: Tandem's priority 0


@dataclass(frozen=True)
class PriorityLevels:
    """Levels 1..count (Triton's `priority_levels`), `default` the level of a request that names none
    (`default_priority_level`); level k is Tandem's priority k - default. ValueError if the levels do not
    fit in [1, LEVELS] or their priorities outside Tandem's [-2^31 + 1, 2^31 - 1]."""
    count: int = LEVELS
    default: int = DEFAULT_LEVEL

    def __post_init__(self):
        if not 1 <= self.count <= LEVELS or not 1 <= self.default <= self.count:
            raise ValueError(f"priority levels must be 1..N with N in [1, {LEVELS}] and the default level in "
                             f"[1, N]; got {self.count} levels, default {self.default}")
        if self.default - 1 > MAX_PRIORITY or self.count - self.default > MAX_PRIORITY:
            raise ValueError(f"level k is priority k - default, which must lie in [-{MAX_PRIORITY}, {MAX_PRIORITY}]: "
                             f"the default level at most {MAX_PRIORITY + 1} and at most {MAX_PRIORITY} levels above "
                             f"it; got {self.count} levels, default {self.default}")

    def priority(self, level: int) -> int:
        """Tandem's priority of a level (0: the default level's)."""
        return level - self.default if level else 0

    def level(self, priority: int) -> int:
        """The level of a Tandem priority (as an OpenAI request's `priority` reads on the KServe doors)."""
        return priority + self.default


@dataclass(frozen=True)
class Schedule:
    priority: int = 0  # Tandem's (lower first)
    timeout_s: float | None = None


def schedule_of(parameters, levels: PriorityLevels = PriorityLevels()) -> Schedule:
    """The schedule a request's parameters ask for (`parameters`: name -> plain value), its level read
    on the served model's `levels`."""
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"parameters must be an object of name: value, got {type(parameters).__name__}",
                              "parameters")
    level = _integer(parameters, "priority", levels.count,
                     f"a priority level: 1 the highest, 0 the model's default (level {levels.default})")
    us = _integer(parameters, "timeout", 2**63 - 1, "microseconds, 0 for none")
    return Schedule(levels.priority(level), us / 1e6 if us else None)


def grpc_parameters(parameters) -> dict:
    """A gRPC request's `parameters` map (name -> InferParameter) as plain values."""
    return {name: getattr(p, p.WhichOneof("parameter_choice")) for name, p in parameters.items()
            if p.WhichOneof("parameter_choice") is not None}


def advertise(dynamic_batching, levels: PriorityLevels) -> None:
    """Say, in the served model's config, how levels are read (Triton's priority_levels fields)."""
    dynamic_batching.priority_levels, dynamic_batching.default_priority_level = levels.count, levels.default


def _integer(parameters: dict, name: str, most: int, what: str) -> int:
    value = parameters.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise InvalidArgument(f"parameter {name} must be an integer in [0, {most}] ({what}), got {value!r:.40}",
                              name)
    return value
