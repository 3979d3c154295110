"""The equal-hardware report's math on hand-made timings: attainment, refusals, sustained rate, claim."""

from __future__ import annotations

import pytest

from clients.bench.slo import attainment, claim_change, refused, sustained, verdict
from clients.bench.stats import RequestRecord, summarize


def test_attainment_counts_failed_and_refused_requests_as_misses():
    rs = [RequestRecord("s", 0.0, [0.1, 0.2, 0.3], output_tokens=3),  # meets TTFT .5 / TPOT .2
          RequestRecord("s", 0.0, [0.9, 1.0], output_tokens=2),  # TTFT too long
          RequestRecord("s", 0.0, [0.1, 0.6], output_tokens=2),  # TPOT .5: too slow
          RequestRecord("s", 0.0, [], error="RESOURCE_EXHAUSTED: 64 requests in flight"),
          RequestRecord("s", 0.0, [], error="HTTP 429: too many"),
          RequestRecord("s", 0.0, [], error="UNAVAILABLE: worker died")]
    s = summarize(rs, slo_ttft=0.5, slo_tpot=0.2)
    assert attainment(s) == pytest.approx(1 / 6)
    assert refused(rs) == 2
    with pytest.raises(ValueError, match="undefined"):
        attainment({"requests": 0})


def test_sustained_rate_interpolates_the_crossing():
    # 100% at 1, 95% at 2, 75% at 3: the 90% crossing lies a quarter of the way from 2 to 3
    assert sustained({1.0: 1.0, 2.0: 0.95, 3.0: 0.75}, 0.9) == {"rate": pytest.approx(2.25), "beyond_range": False}
    assert sustained({1.0: 1.0, 2.0: 0.95}, 0.9) == {"rate": 2.0, "beyond_range": True}
    assert sustained({1.0: 0.5, 2.0: 0.2}, 0.9)["rate"] == 0.0


def _summary(ttft_p50, ttft_mean, window):
    return {"ttft_s": {"p50": ttft_p50, "mean": ttft_mean}, "window_s": window}


def test_claim_change_and_verdict():
    change = claim_change(_summary(3.0, 6.0, 78.0), _summary(4.0, 8.0, 100.0))
    assert change == {"ttft_p50_reduction": pytest.approx(0.25), "ttft_mean_reduction": pytest.approx(0.25),
                      "total_reduction": pytest.approx(0.22)}
    assert verdict(change).endswith("reaches the claim (TTFT -25%, total -22%)")
    worse = claim_change(_summary(5.0, 10.0, 120.0), _summary(4.0, 8.0, 100.0))
    assert worse["total_reduction"] == pytest.approx(-0.2)
    assert "TTFT mean +25%, total time +20%: does not reach" in verdict(worse)
    with pytest.raises(ValueError, match="failed"):
        claim_change({"error": "no request completed"}, _summary(1, 1, 1))
