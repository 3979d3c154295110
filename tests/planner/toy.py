"""Hand-made profiles for the planner's tests: every time in them is chosen so timelines are exact."""

from __future__ import annotations

from planner.profile import Profile, parse_profile


def toy_profile(*, prefill: dict | None = None, decode: dict | None = None, serving: dict | None = None,
                handoff: dict | None = None, frontdoor: dict | None = None, model: dict | None = None,
                scaling: dict | None = None, served: dict | None = None) -> Profile:
    """A valid profile; each argument replaces (is merged into) one section."""
    doc = {
        "format": "tandem-profile/1", "name": "toy", "hardware": {"device": "toy device"},
        "model": {"name": "toy", "params": 1000, "kv_bytes_per_token": 1000, **(model or {})},
        "serving": {"pass_tokens": 512, "tokens_per_page": 16, "kv_pool_bytes": 10 ** 9, **(serving or {})},
        "prefill": {"fit": prefill or {"intercept_s": 0.1, "per_token_s": 0.0}},
        "decode": {"fit": decode or {"intercept_s": 0.2}},
        "handoff": handoff or {"gbytes_per_s": 1e6, "latency_s": 0.0},
        "frontdoor": frontdoor or {"ttft_s": 0.0, "per_token_s": 0.0},
    }
    if scaling is not None:
        doc["scaling"] = scaling
    if served is not None:
        doc["served"] = served
    return parse_profile(doc)
