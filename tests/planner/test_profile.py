"""Profiles: validation names the field, fits recover known models, scaling is never assumed."""

from __future__ import annotations

import json

import pytest

from planner.costs import PassCosts
from planner.profile import ProfileError, dump_profile, load_profile, parse_profile
from planner.sim.sim_layouts import layouts_for, speedup
from tests.planner.toy import toy_profile


def _doc() -> dict:
    return json.loads(dump_profile(toy_profile()))


def test_wrong_format_is_refused():
    doc = _doc() | {"format": "tandem-profile/2"}
    with pytest.raises(ProfileError, match="'format' must be 'tandem-profile/1', got 'tandem-profile/2'"):
        parse_profile(doc)


def test_unknown_key_names_the_field_and_the_allowed_keys():
    doc = _doc()
    doc["handoff"]["gbps"] = 5
    with pytest.raises(ProfileError) as e:
        parse_profile(doc)
    assert "handoff.gbps: unknown key; allowed: gbytes_per_s, how, latency_s" in str(e.value)


def test_bad_values_name_their_field():
    doc = _doc()
    doc["decode"]["fit"]["intercept_s"] = -1
    doc["serving"]["pass_tokens"] = 0
    with pytest.raises(ProfileError) as e:
        parse_profile(doc)
    assert "decode.fit.intercept_s: Input should be greater than or equal to 0" in str(e.value)
    assert "serving.pass_tokens: Input should be greater than 0" in str(e.value)


def test_a_phase_needs_points_or_a_fit():
    doc = _doc()
    doc["prefill"] = {"how": "nothing"}
    with pytest.raises(ProfileError, match="prefill: Value error, give measured 'points', a 'fit', or both"):
        parse_profile(doc)


def test_missing_device_and_bad_json_file(tmp_path):
    doc = _doc()
    doc["hardware"] = {"cores": 8}
    with pytest.raises(ProfileError, match="hardware needs at least a 'device' entry"):
        parse_profile(doc)
    bad = tmp_path / "p.json"
    bad.write_text('{"format": "tandem-profile/1",\n  "name": }')
    with pytest.raises(ProfileError, match=r"is not valid JSON: Expecting value at line 2, column 11"):
        load_profile(str(bad))
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(str(tmp_path / "missing.json"))


def test_fit_recovers_the_model_that_made_the_points(tmp_path):
    a, b, c, d = 0.02, 1e-4, 1e-8, 3e-3  # prefill: intercept, per token, per attention pair, per sequence
    shapes = [(64, 1), (512, 1), (2048, 1), (8192, 1), (2048, 8), (8192, 16), (4096, 64)]
    pre = [{"tokens": t, "sequences": s, "seconds": a + b * t + c * t * t / s + d * s} for t, s in shapes]
    dec = [{"batch": bb, "context_tokens": ctx, "seconds": 0.005 + 2e-5 * bb + 1e-8 * ctx}
           for bb, ctx in [(1, 100), (8, 4000), (64, 30000), (256, 200000), (32, 500)]]
    doc = _doc()
    doc["prefill"], doc["decode"] = {"points": pre}, {"points": dec}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    p = load_profile(str(path))
    f = p.prefill.fit
    assert (f.intercept_s, f.per_token_s, f.per_attention_s, f.per_sequence_s) == pytest.approx((a, b, c, d), rel=1e-6)
    assert p.prefill.fit_error.max_rel < 1e-9
    g = p.decode.fit
    assert (g.intercept_s, g.per_sequence_s, g.per_context_token_s, g.per_log2_batch_s) == \
        pytest.approx((0.005, 2e-5, 1e-8, 0.0), rel=1e-6, abs=1e-12)
    again = parse_profile(json.loads(dump_profile(p)))  # a written profile reads back the same
    assert again == p


def test_fit_never_goes_negative():
    # time falling with tokens cannot be fitted by a positive slope; the fit keeps coefficients >= 0
    doc = _doc()
    doc["prefill"] = {"points": [{"tokens": 10, "seconds": 1.0}, {"tokens": 100, "seconds": 0.5}]}
    f = parse_profile(doc).prefill.fit
    assert min(f.intercept_s, f.per_token_s, f.per_attention_s, f.per_sequence_s) >= 0


def test_chunks_cost_what_the_whole_prompt_costs_in_attention():
    costs = PassCosts.of(toy_profile(prefill={"intercept_s": 0.0, "per_token_s": 0.0, "per_attention_s": 1.0}))
    whole = costs.prefill_time([(0, 300)])
    chunks = sum(costs.prefill_time([(s, min(128, 300 - s))]) for s in range(0, 300, 128))
    assert chunks == pytest.approx(whole) == pytest.approx(300 ** 2)


def test_speedup_is_interpolated_between_given_counts_and_never_extrapolated():
    p = toy_profile(scaling={"prefill": {"2": 1.8, "8": 6.0}, "decode": {"2": 1.5, "8": 5.0}})
    assert speedup(p, "prefill", 1) == 1.0
    assert speedup(p, "prefill", 4) == pytest.approx(1.8 + (6.0 - 1.8) * 2 / 6)
    assert speedup(p, "decode", 8) == 5.0
    assert speedup(p, "decode", 16) is None
    names = [x.name for x in layouts_for(p, 8)[0]]
    assert names == ["1P7D", "2P6D", "3P5D", "4P4D", "5P3D", "6P2D", "7P1D", "colocated 8x1", "colocated 1x8",
                     "chunked 8x1", "chunked 1x8"]
    layouts, skipped = layouts_for(p, 16)
    assert "colocated 1x16" not in [x.name for x in layouts]
    assert "linear scaling is not assumed" in skipped["colocated 1x16"]
