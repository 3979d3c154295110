"""The served model's load in vLLM's series names, so schedulers and autoscalers written for vLLM read
the front door unchanged: the Gateway API Inference Extension's endpoint picker (llm-d's scheduler)
scrapes these names by default (its model server protocol), and KEDA or HPA rules keyed on
`vllm:num_requests_waiting` scale a Tandem deployment as they scale vLLM. Labelled `model_name` (the
served name), as vLLM labels them.

- `vllm:num_requests_waiting` (gauge): requests arrived with no first token yet: being tokenized, queued
  for a worker, or in prefill (as `tandem_requests_waiting`);
- `vllm:num_requests_running` (gauge): requests streaming: first token sent, not ended;
- `vllm:kv_cache_usage_perc` (gauge, 0 to 1): the pages used over the pages of the pools a request
  generates in (decode workers'; co-located workers' in the baselines), as each worker last reported
  them; 0 with no such worker;
- `vllm:cache_config_info` (gauge, 1): labels `block_size` (the tokens a KV page holds) and
  `num_gpu_blocks` (the pages of those pools).

The two request gauges move with the front door's own (frontdoor/door_metrics.RequestMeter); the pool
numbers are read from the fleet at scrape time (frontdoor/worker_metrics.WorkerCollector's fleet).
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from tandem.roles import Role


class VllmCollector:
    """A prometheus_client collector: `waiting` and `running` are kept by the request meters."""

    def __init__(self, model: str, tokens_per_page: int, workers):
        """`workers`: the WorkerCollector whose fleet reports the pools."""
        self.model, self.tokens_per_page, self.workers = model, tokens_per_page, workers
        self.waiting = self.running = 0

    def collect(self):
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
