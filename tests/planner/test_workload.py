"""Workloads: length forms, clear errors, and seeded draws."""

from __future__ import annotations

import numpy as np
import pytest

from planner.plan_workload import (ClosedLoop, Empirical, Fixed, Normal, Poisson, Uniform, Workload, WorkloadError, draw,
                              parse_length)


def test_length_forms(tmp_path):
    assert parse_length("512") == Fixed(value=512)
    assert parse_length("uniform:128:1024") == Uniform(low=128, high=1024)
    assert parse_length("normal:512:128") == Normal(mean=512, std=128)
    assert parse_length("normal:512:128:64:2048") == Normal(mean=512, std=128, low=64, high=2048)
    assert parse_length("list:100,200") == Empirical(values=(100, 200))
    f = tmp_path / "lengths.txt"
    f.write_text("10\n20\n\n30\n")
    assert parse_length(f"file:{f}") == Empirical(values=(10, 20, 30))
    f.write_text("[5, 6]")
    assert parse_length(f"file:{f}") == Empirical(values=(5, 6))


@pytest.mark.parametrize("text, why", [
    ("0", "value: Input should be greater than or equal to 1"),
    ("uniform:9:3", "uniform needs low <= high"),
    ("normal:5", "normal takes mean:std or mean:std:low:high"),
    ("zipf:1", "unknown kind 'zipf'"),
    ("list:1,x", "invalid literal"),
    ("file:/nonexistent/lengths", "cannot read /nonexistent/lengths"),
])
def test_bad_lengths_say_what_is_allowed(text, why):
    with pytest.raises(WorkloadError) as e:
        parse_length(text)
    assert why in str(e.value) and "write a length as N, uniform:LOW:HIGH" in str(e.value)


def test_draws_are_seeded_clipped_and_poisson():
    w = Workload(prompt=Normal(mean=100, std=80, low=10, high=150), output=Uniform(low=1, high=4),
                 arrivals=Poisson(rate=50.0), requests=20_000, seed=11)
    a, b = draw(w), draw(w)
    assert a == b
    prompts = np.array([r.prompt_len for r in a])
    assert prompts.min() == 10 and prompts.max() == 150
    assert {r.output_len for r in a} == {1, 2, 3, 4}
    gaps = np.diff([0.0] + [r.arrival for r in a])
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)  # 20k exponential gaps: sd of the mean is 0.7%
    closed = draw(w.with_arrivals(ClosedLoop(concurrency=3)))
    assert all(r.arrival is None for r in closed)
    assert draw(w.model_copy(update={"seed": 12})) != a
