"""Statistics of a benchmark run: percentiles, throughput and goodput from per-request timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    stream: str
    start: float  # seconds since the run started
    response_times: list[float] = field(default_factory=list)  # seconds since `start`, one per response
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    warmup: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.response_times)

    @property
    def ttft(self) -> float:
        return self.response_times[0]

    @property
    def e2e(self) -> float:
        return self.response_times[-1]

    @property
    def gaps(self) -> list[float]:
        r = self.response_times
        return [b - a for a, b in zip(r, r[1:])]

    @property
    def tpot(self) -> float:
        """Time per output token after the first."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]), like numpy's default."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def dist(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "max": max(values) if values else float("nan"), "mean": sum(values) / len(values) if values else float("nan")}


def summarize(records: list[RequestRecord], slo_ttft: float, slo_tpot: float, streams: list[str] | None = None) -> dict:
    """Statistics over measured (non-warm-up) requests, optionally of some streams only.

    Throughput and goodput divide by the measured window: first measured request's start to the last
    measured request's end. Goodput counts requests with TTFT <= slo_ttft and TPOT <= slo_tpot.
    """
    rs = [r for r in records if not r.warmup and (streams is None or r.stream in streams)]
    ok = [r for r in rs if r.ok]
    if not ok:
        return {"requests": len(rs), "failed": len(rs), "error": "no request completed"}
    window = max(r.start + r.e2e for r in ok) - min(r.start for r in rs)
    good = [r for r in ok if r.ttft <= slo_ttft and r.tpot <= slo_tpot]
    return {
        "requests": len(rs), "failed": len(rs) - len(ok), "window_s": window,
        "ttft_s": dist([r.ttft for r in ok]), "itl_s": dist([g for r in ok for g in r.gaps]),
        "tpot_s": dist([r.tpot for r in ok if r.output_tokens > 1]), "e2e_s": dist([r.e2e for r in ok]),
        "throughput_rps": len(ok) / window, "output_tokens_per_s": sum(r.output_tokens for r in ok) / window,
        "goodput_rps": len(good) / window, "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "met_slo": len(good),
    }
