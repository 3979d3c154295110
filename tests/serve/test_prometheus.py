"""A real Prometheus (Debian's `prometheus` package) scraping a running `tandem serve`: the front door's
/metrics and every worker's Triton metrics port, with the PrometheusRule of
deploy/kubernetes/components/monitoring loaded. PromQL for TTFT p50, refusals per second, queue depth
and prefix-cache hit rate answers with data; every dashboard query returns series; every rule parses
(promtool) and evaluates without error."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import urllib.request

import pytest

from tests.conftest import GUARD_KEY
from tests.serve.clients import post
from tests.serve.hold import held
from tests.serve.promserver import MONITORING, Prometheus, binary, values, write_rules

pytestmark = pytest.mark.skipif(binary() is None, reason="no `prometheus` binary: Debian's prometheus package "
                                "is not installed (apt-get install prometheus; .ci/run installs it when root)")

AUTH = {"Authorization": f"Bearer {GUARD_KEY}"}
# ~120 prompt tokens: 7 full pages of 16, found in the prefill worker's prefix cache the second time
LONG = " ".join(f"Item {i} is a line of a list that the model reads twice." for i in range(10))


def test_promtool_accepts_the_rules(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "the prometheus package ships promtool"
    out = subprocess.run([promtool, "check", "rules", write_rules(str(tmp_path / "rules.yml"))],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS: 10 rules found" in out.stdout, out.stdout + out.stderr


@pytest.fixture(scope="module")
def prom(guarded, tmp_path_factory):
    targets = {"tandem-front-door": [guarded.http.removeprefix("http://")],
               "tandem-workers": [w["metrics"] for w in guarded.workers().values()]}
    with Prometheus(str(tmp_path_factory.mktemp("prometheus")), targets) as p:
        p.wait_for(f"count(up == 1) == {1 + len(targets['tandem-workers'])}")
        p.wait_for('tandem_request_failures_total{status="RESOURCE_EXHAUSTED"}')  # scraped at 0 once
        yield p


@pytest.fixture(scope="module")
def traffic(guarded, prom):
    """Served requests (one prompt twice: prefix-cache hits), and while one is held, a queue of one and
    three refusals (429: one request in flight is the limit)."""
    for _ in range(2):
        status, body = post(guarded.http, "/v1/completions", {"prompt": LONG, "max_tokens": 8}, headers=AUTH)
        assert status == 200, body
    with held(guarded, headers=AUTH) as first:
        for _ in range(3):
            status, body = post(guarded.http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers=AUTH)
            assert status == 429 and body["error"]["code"] == "RESOURCE_EXHAUSTED", body
        prom.wait_for("sum(tandem_requests_waiting) >= 1")  # scraped while it waits
    assert first.result(timeout=120)[0] == 200
    return prom


def test_ttft_refusals_queue_depth_and_cache_hit_rate_answer_with_data(traffic):
    ttft = values(traffic.wait_for("histogram_quantile(0.5, sum by (le) (rate(tandem_ttft_seconds_bucket[1m]))) > 0"))
    assert len(ttft) == 1 and math.isfinite(ttft[0])
    refusals = traffic.wait_for(
        'sum by (status) (rate(tandem_request_failures_total{status="RESOURCE_EXHAUSTED"}[1m])) > 0')
    assert refusals[0]["metric"] == {"status": "RESOURCE_EXHAUSTED"}
    assert values(traffic.wait_for("max_over_time(sum(tandem_requests_waiting)[2m:1s]) >= 1")) == [1]
    # the same queue in vLLM's name, as schedulers and autoscalers written for vLLM query it
    assert values(traffic.wait_for("max_over_time(sum(vllm:num_requests_waiting)[2m:1s]) >= 1")) == [1]
    # the workers' own Triton series, from their metrics ports: both role models served requests
    served = traffic.wait_for('sum by (model) (nv_inference_request_success{job="tandem-workers"}) > 0')
    assert len(served) >= 2, served
    hits = traffic.wait_for("tandem:prefix_cache_hit_ratio:rate5m > 0")  # the recording rule, evaluated
    assert "prefill-0" in {r["metric"]["worker"] for r in hits} and all(0 < v <= 1 for v in values(hits))


def test_every_dashboard_query_returns_series(traffic):
    with open(f"{MONITORING}/tandem-dashboard.json") as f:
        panels = json.load(f)["panels"]
    exprs = [(p["title"], t["expr"]) for p in panels for t in p.get("targets", ())]
    assert len(exprs) >= 10
    empty = []
    for title, expr in exprs:
        try:
            traffic.wait_for(expr, timeout_s=30)
        except Exception as e:  # noqa: BLE001 - collect every empty panel, then fail naming them all
            empty.append(f"{title}: {e}")
    assert not empty


def test_every_rule_evaluates_and_recording_rules_have_data(traffic):
    for name in ("tandem:ttft_seconds:p99_5m", "tandem:itl_seconds:p99_5m", "tandem:request_error_ratio:rate5m",
                 "tandem:prefix_cache_hit_ratio:rate5m"):
        traffic.wait_for(name)
    with urllib.request.urlopen(traffic.url + "/api/v1/rules") as r:
        groups = json.load(r)["data"]["groups"]
    rules = [rule for g in groups for rule in g["rules"]]
    assert len(rules) == 10
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
