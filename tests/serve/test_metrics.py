"""The front door's /metrics as Prometheus and Triton dashboards read it, from a real `tandem serve`:
parsed with prometheus_client's own parser, counted from arrival, refusals included, per model."""

from __future__ import annotations

import json
import re
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.serve.clients import grpc_infer, post


def scrape(http: str, raw: list | None = None) -> dict:
    """{(sample name, frozenset(labels)): value} and the family types, as Prometheus would read them
    (the parser names every counter sample `..._total`); `raw` gets the text itself."""
    with urllib.request.urlopen(http + "/metrics") as r:
        text = r.read().decode()
    if raw is not None:
        raw.append(text)
    families = list(text_string_to_metric_families(text))
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    return samples, {f.name: f.type for f in families}


def value(samples, name, **labels) -> float:
    """The sum of `name` over the label sets that include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_requests_refusals_and_workers_are_counted_the_prometheus_way(served):
    model = "smollm2-135m"
    before, _ = scrape(served.http)
    status, body = post(served.http, "/v1/completions", {"model": model, "prompt": "The sky is", "max_tokens": 5})
    assert status == 200, body
    assert grpc_infer(served.grpc, "Hello", 3)
    status, _ = post(served.http, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 10**6})
    assert status == 400
    deadline, raw = time.monotonic() + 10, []
    while True:  # the gauges drop as the streams close, just after the answers
        after, types = scrape(served.http, raw)
        if value(after, "tandem_requests_waiting") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("tandem_request_finished_total", model=model) == 2
    assert grew("nv_inference_request_success_total", model=model, version="1") == 2
    assert re.search(rf'^nv_inference_request_success{{model="{model}",version="1"}} \d', raw[-1], re.M)  # Triton's name
    assert grew("nv_inference_count_total", model=model) == 2
    assert grew("nv_inference_request_duration_us_total", model=model) > 0
    assert grew("tandem_output_tokens_total", model=model) == 8  # 5 + 3, greedy, no EOS that soon
    assert grew("tandem_prompt_tokens_total", model=model) > 2
    assert grew("tandem_request_failures_total", model=model, status="INVALID_ARGUMENT") == 1  # a refusal counts
    assert grew("nv_inference_request_failure_total", model=model, reason="REJECTED") == 1
    assert grew("tandem_ttft_seconds_count", model=model) == 2
    assert value(after, "tandem_requests_waiting", model=model) == 0
    assert value(after, "tandem_requests_in_flight", model=model) == 0
    assert value(after, "nv_inference_pending_request_count", model=model) == 0
    # worker series: stable slot names and roles, never an address; cache totals are counters
    workers = {dict(ls)["worker"] for (n, ls), _ in after.items() if n == "tandem_kv_pages_total"}
    assert workers == {"decode-0"} or workers == {"prefill-0", "decode-0"}
    assert types["tandem_prefix_cache_hit_pages"] == "counter"
    assert types["nv_inference_request_success"] == "counter" and types["tandem_requests_waiting"] == "gauge"


def test_alerts_rules_and_dashboard_use_only_series_the_front_door_exports(served):
    """Every metric a rule, alert or dashboard panel of deploy/kubernetes/components/monitoring reads is
    one a live front door exports (a renamed metric would silently empty a panel or mute an alert)."""
    import json

    import yaml

    grpc_infer(served.grpc, "Hi", 2)  # so every labelled series has a sample
    samples, _ = scrape(served.http)
    exported = {n for n, _ in samples} | {n.removesuffix("_total") for n, _ in samples}
    folder = "deploy/kubernetes/components/monitoring"
    with open(f"{folder}/rules.yaml") as f:
        rules = [r for g in yaml.safe_load(f)["spec"]["groups"] for r in g["rules"]]
    with open(f"{folder}/tandem-dashboard.json") as f:
        panels = json.load(f)["panels"]
    exprs = [r["expr"] for r in rules] + [t["expr"] for p in panels for t in p["targets"]]
    recorded = {r["record"] for r in rules if "record" in r}
    used = {m for e in exprs for m in re.findall(r"[\w:]*(?:tandem|nv_inference)[\w:]*", e)}
    assert used - recorded and not {m for m in used - recorded - exported if ":" not in m}
    assert {m for m in used if ":" in m} <= recorded  # recording rules read are defined here


def _until(http: str, ok, what: str, timeout_s: float = 30.0) -> dict:
    """Scrape until `ok(samples)`; the samples then (AssertionError naming `what` after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not ok(samples := scrape(http)[0]):
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f}s"
        time.sleep(0.2)
    return samples


def test_the_load_is_exported_in_vllms_names_for_schedulers_and_autoscalers(served):
    """frontdoor/vllm_metrics.py: idle, nothing waits or runs; while an answer streams, vLLM's running
    gauge counts it and the decode pool's usage (as the worker reports it) is above 0; once the client
    left, both fall back; the page size and pages are Tandem's own series'."""
    model = "smollm2-135m"
    load = lambda s, n: value(s, f"vllm:{n}", model_name=model)  # noqa: E731
    idle = _until(served.http, lambda s: load(s, "num_requests_running") == load(s, "num_requests_waiting") == 0,
                  "an idle front door")
    types = scrape(served.http)[1]
    assert {types[f"vllm:{n}"] for n in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc",
                                        "cache_config_info")} == {"gauge"}
    [info] = [dict(ls) for (n, ls) in idle if n == "vllm:cache_config_info"]
    assert info == {"model_name": model, "block_size": str(int(value(idle, "tandem_kv_tokens_per_page"))),
                    "num_gpu_blocks": str(int(value(idle, "tandem_kv_pages_total", role="decode")))}
    body = {"prompt": "Count upwards:", "max_tokens": 1500, "ignore_eos": True, "stream": True, "temperature": 0}
    req = urllib.request.Request(served.http + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.readline().startswith(b"data: ")  # its first token came: it streams
        during = _until(served.http, lambda s: load(s, "kv_cache_usage_perc") > 0, "the decode pool's usage")
        assert load(during, "num_requests_running") == 1 and load(during, "num_requests_waiting") == 0
        assert load(during, "kv_cache_usage_perc") <= 1
    _until(served.http, lambda s: load(s, "num_requests_running") == 0, "the left stream's end")


def test_the_request_series_are_also_in_vllms_names(served):
    """vLLM's dashboards' series are the front door's own, renamed: the same values, `model` as
    `model_name`, `reason` as `finished_reason`."""
    model = "smollm2-135m"
    status, body = post(served.http, "/v1/completions", {"prompt": "The sky is", "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    samples, types = scrape(served.http)
    for ours, theirs in (("tandem_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("tandem_output_tokens_total", "vllm:generation_tokens_total"),
                         ("tandem_ttft_seconds_count", "vllm:time_to_first_token_seconds_count"),
                         ("tandem_ttft_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
                         ("tandem_itl_seconds_count", "vllm:inter_token_latency_seconds_count"),
                         ("tandem_tpot_seconds_count", "vllm:request_time_per_output_token_seconds_count"),
                         ("tandem_e2e_seconds_count", "vllm:e2e_request_latency_seconds_count")):
        assert value(samples, theirs, model_name=model) == value(samples, ours, model=model) > 0, theirs
    assert value(samples, "vllm:request_success_total", model_name=model, finished_reason="length") == \
        value(samples, "tandem_request_finished_total", model=model, reason="length") > 0
    assert value(samples, "vllm:e2e_request_latency_seconds_bucket", model_name=model, le="+Inf") == \
        value(samples, "tandem_e2e_seconds_count", model=model)
    assert types["vllm:time_to_first_token_seconds"] == "histogram" and types["vllm:prompt_tokens"] == "counter"
