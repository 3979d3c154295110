"""The serving layouts N devices allow, named as in reports.

- `xPyD`: x prefill and y decode workers, one device each, for every x + y = N.
- `colocated Nx1`: N co-located (prefill-first) replicas of one device each.
- `colocated 1xN`: one co-located worker spread over all N devices (tensor parallel on GPUs,
  N threads on a CPU); its step times are divided by the profile's speedup for N devices.
- `chunked Nx1`, `chunked 1xN`: the same with chunked prefill.
A 1xN layout is skipped when the profile gives no speedup for N devices: linear scaling is never
assumed. The speedup for N is the profile's value for N, or linear interpolation between the two
nearest device counts it gives (N = 1 is 1.0); never extrapolated beyond the largest.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.profile import Profile

KINDS = ("disaggregated", "colocated", "chunked")


@dataclass(frozen=True)
class Layout:
    kind: str  # one of KINDS
    workers: int  # prefill workers (disaggregated) or replicas
    decode_workers: int = 0
    devices_per_worker: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layout kind {self.kind!r} unknown; allowed: {', '.join(KINDS)}")
        if self.workers < 1 or (self.kind == "disaggregated") != (self.decode_workers >= 1):
            raise ValueError("a disaggregated layout needs >= 1 prefill and >= 1 decode worker; others neither")

    @property
    def devices(self) -> int:
        return (self.workers + self.decode_workers) * self.devices_per_worker

    @property
    def name(self) -> str:
        if self.kind == "disaggregated":
            return f"{self.workers}P{self.decode_workers}D"
        return f"{self.kind} {self.workers}x{self.devices_per_worker}"


def speedup(profile: Profile, phase: str, devices: int) -> float | None:
    """One worker's speedup on `devices` devices for `phase` ('prefill' | 'decode'); None if unknown."""
    table = dict(getattr(profile.scaling, phase))
    table.setdefault(1, 1.0)
    if devices in table:
        return table[devices]
    below = [n for n in table if n < devices]
    above = [n for n in table if n > devices]
    if not above:
        return None
    lo, hi = max(below), min(above)
    return table[lo] + (table[hi] - table[lo]) * (devices - lo) / (hi - lo)


def layouts_for(profile: Profile, devices: int) -> tuple[list[Layout], dict[str, str]]:
    """Every layout of exactly `devices` devices, and the ones skipped with the reason."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    out = [Layout("disaggregated", x, devices - x) for x in range(1, devices)]
    skipped: dict[str, str] = {}
    for kind in ("colocated", "chunked"):
        out.append(Layout(kind, devices))
        if devices == 1:
            continue
        one = Layout(kind, 1, devices_per_worker=devices)
        missing = [ph for ph in ("prefill", "decode") if speedup(profile, ph, devices) is None]
        if missing:
            skipped[one.name] = (f"the profile gives no {' or '.join(missing)} speedup for {devices} devices "
                                 f"(add scaling.{missing[0]}[\"{devices}\"]; linear scaling is not assumed)")
        else:
            out.append(one)
    return out, skipped
