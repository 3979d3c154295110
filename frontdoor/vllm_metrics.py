"""The served model's load (and request series) in vLLM's names, so schedulers, autoscalers and
dashboards written for vLLM read the front door unchanged: the Gateway API Inference Extension's
endpoint picker (llm-d's scheduler) scrapes the load's names by default (its model server protocol),
and KEDA or HPA rules keyed on `vllm:num_requests_waiting` scale a Tandem deployment as they scale
vLLM. Labelled `model_name` (the served name), as vLLM labels them.

- `vllm:num_requests_waiting` (gauge): requests arrived with no first token yet: being tokenized, queued
  for a worker, or in prefill (as `tandem_requests_waiting`);
- `vllm:num_requests_running` (gauge): requests streaming: first token sent, not ended;
- `vllm:kv_cache_usage_perc` (gauge, 0 to 1): the pages used over the pages of the pools a request
  generates in (decode workers'; co-located workers' in the baselines), as each worker last reported
  them; 0 with no such worker;
- `vllm:cache_config_info` (gauge, 1): labels `block_size` (the tokens a KV page holds) and
  `num_gpu_blocks` (the pages of those pools);
- `vllm:lora_requests_info` (gauge: the scrape's Unix time, so the newest is found), once LoRA adapters are
  watched: labels `running_lora_adapters` (the adapters a request may name, comma-separated: every one is
  on every worker, ready to serve), `waiting_lora_adapters` (always empty: no request waits for an
  adapter to load) and `max_lora` (lora_loading.max_adapters): what the endpoint picker's LoRA affinity
  reads.

vLLM's dashboards read the request series too; these are the front door's own
(frontdoor/door_metrics.py), renamed at scrape time (nothing more is counted per token):
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:request_time_per_output_token_seconds` and `vllm:e2e_request_latency_seconds` (histograms,
Tandem's buckets), `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` and
`vllm:request_success_total` (`finished_reason`) (counters).

The two request gauges move with the front door's own (frontdoor/door_metrics.RequestMeter); the pool
numbers are read from the fleet at scrape time (frontdoor/worker_metrics.WorkerCollector's fleet).
"""

from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily, Metric

from tandem.roles import Role


_LABELS = {"model": "model_name", "reason": "finished_reason"}  # Tandem's label -> vLLM's; others dropped


class VllmCollector:
    """A prometheus_client collector: `waiting` and `running` are kept by the request meters."""

    def __init__(self, model: str, tokens_per_page: int, workers, renamed: dict[str, object]):
        """`workers`: the WorkerCollector whose fleet reports the pools; `renamed`: vLLM's name of each
        front-door metric exported again under it."""
        self.model, self.tokens_per_page, self.workers, self.renamed = model, tokens_per_page, workers, renamed
        self.waiting = self.running = 0
        self.adapters = None  # the served LoRA adapters (control/adapters.py), once `watch_adapters` is called

    def watch_adapters(self, adapters) -> None:
        self.adapters = adapters

    def collect(self):
        for name, metric in self.renamed.items():
            for family in metric.collect():
                yield _as(family, name)
        fleet = self.workers.fleet
        pools = [w.stats for w in (fleet.workers.values() if fleet else ()) if w.role is not Role.PREFILL
                 and w.stats is not None and w.stats.pages_total]
        used, total = sum(s.pages_used for s in pools), sum(s.pages_total for s in pools)
        for name, help_, value in (
                ("vllm:num_requests_waiting", "Requests arrived with no first token yet", self.waiting),
                ("vllm:num_requests_running", "Requests streaming their answer", self.running),
                ("vllm:kv_cache_usage_perc", "KV-cache usage of the pools requests generate in; 1 is 100 percent",
                 used / total if total else 0.0)):
            g = GaugeMetricFamily(name, help_, labels=["model_name"])
            g.add_metric([self.model], value)
            yield g
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's page size and pages",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([self.model, str(self.tokens_per_page), str(total)], 1.0)
        yield info
        if self.adapters is not None:
            lora = GaugeMetricFamily("vllm:lora_requests_info", "The LoRA adapters served (value: when, Unix time)",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            lora.add_metric([str(self.adapters.max_adapters), ",".join(self.adapters), ""], time.time())
            yield lora


def _as(family: Metric, name: str) -> Metric:
    """`family` under `name`, its labels in vLLM's names (the `mode` label, one value a process, dropped)."""
    out = Metric(name, family.documentation, family.type)
    for sample in family.samples:
        labels = {_LABELS[k]: v for k, v in sample.labels.items() if k in _LABELS} | \
            ({"le": sample.labels["le"]} if "le" in sample.labels else {})
        out.add_sample(name + sample.name.removeprefix(family.name), labels, sample.value, sample.timestamp)
    return out
