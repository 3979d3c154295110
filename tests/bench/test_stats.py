"""The bench's statistics on hand-made timings."""

from __future__ import annotations

import dataclasses

import pytest

from clients.bench.stats import RequestRecord, percentile, summarize
from clients.bench.bench_workload import SCENARIOS, Scenario, Stream, requests_for


def test_percentiles_interpolate_linearly():
    v = [4.0, 1.0, 3.0, 2.0]
    assert percentile(v, 0) == 1.0 and percentile(v, 100) == 4.0
    assert percentile(v, 50) == pytest.approx(2.5) and percentile(v, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0


def records() -> list[RequestRecord]:
    return [
        RequestRecord("s", 0.0, [0.1, 0.2, 0.3, 0.4], output_tokens=4),  # TTFT .1, TPOT .1
        RequestRecord("s", 0.5, [0.5, 0.55, 0.6], output_tokens=3),  # TTFT .5, TPOT .05
        RequestRecord("s", 1.0, [0.2, 1.2], output_tokens=2),  # TTFT .2, TPOT 1.0 (a stall)
        RequestRecord("s", 0.3, [], error="boom"),  # failed
        RequestRecord("s", -1.0, [5.0], output_tokens=1, warmup=True),  # left out
    ]


def test_summary_throughput_and_goodput():
    s = summarize(records(), slo_ttft=0.3, slo_tpot=0.2)
    assert s["requests"] == 4 and s["failed"] == 1
    assert s["window_s"] == pytest.approx(2.2)  # first measured start 0.0 .. last end 1.0 + 1.2
    assert s["throughput_rps"] == pytest.approx(3 / 2.2)
    assert s["output_tokens_per_s"] == pytest.approx(9 / 2.2)
    assert s["met_slo"] == 1 and s["goodput_rps"] == pytest.approx(1 / 2.2)  # only the first meets both SLOs
    assert s["ttft_s"]["p50"] == pytest.approx(0.2) and s["ttft_s"]["max"] == pytest.approx(0.5)
    gaps = [0.1, 0.1, 0.1, 0.05, 0.05, 1.0]
    assert s["itl_s"]["max"] == pytest.approx(1.0) and s["itl_s"]["p50"] == pytest.approx(percentile(gaps, 50))
    assert s["tpot_s"]["p50"] == pytest.approx(0.1) and s["e2e_s"]["p50"] == pytest.approx(0.6)


def test_per_stream_summary_and_nothing_completed():
    rs = records() + [RequestRecord("t", 0.0, [], error="x")]
    assert summarize(rs, 1, 1, ["t"])["error"] == "no request completed"
    assert summarize(rs, 1, 1, ["s"])["requests"] == 4


def test_workloads_are_seeded_and_sized(default_engine):
    tok = default_engine.tokenizer
    a = requests_for(SCENARIOS["stall"], tok)
    b = requests_for(SCENARIOS["stall"], tok)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    longs = [r for r in a if r.stream == "long"]
    assert len(longs) == 4 and all(abs(len(tok.encode(r.prompt)) - 1536) <= 2 for r in longs)
    assert [r.arrival for r in longs] == [2.0, 7.0, 12.0, 17.0]
    poisson = requests_for(Scenario("p", (Stream("p", 8, 4, 50, rate=10.0),), seed=3), tok)
    gaps = [b.arrival - a.arrival for a, b in zip(poisson, poisson[1:])]
    assert all(g > 0 for g in gaps) and 0.05 < sum(gaps) / len(gaps) < 0.2  # mean 1/rate = 0.1 s
    with pytest.raises(ValueError, match="exactly one of"):
        Stream("x", 8, 8, 1, concurrency=2, rate=1.0)


def test_requests_name_adapters_drawn_by_the_seed_and_keep_their_prompts(default_engine):
    """`tandem bench --lora-modules`: each request names one of the models, drawn by the scenario's seed
    apart from everything else, so the prompts, lengths and arrivals are those of the run without."""
    tok = default_engine.tokenizer
    plain = Scenario("p", (Stream("p", 8, 4, 40, rate=10.0),), seed=3)
    named = dataclasses.replace(plain, models=("a", "b"))
    a, b = requests_for(named, tok), requests_for(plain, tok)
    assert [(r.prompt, r.max_tokens, r.arrival) for r in a] == [(r.prompt, r.max_tokens, r.arrival) for r in b]
    assert {r.model for r in b} == {""} and {r.model for r in a} == {"a", "b"}
    assert [r.model for r in a] == [r.model for r in requests_for(named, tok)]  # the same seed, the same draw
    assert [r.model for r in a] != [r.model for r in requests_for(dataclasses.replace(named, seed=4), tok)]
