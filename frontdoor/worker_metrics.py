"""The workers' own numbers, as each last pushed them (control/fleet.py), exported at scrape time.

A worker reports running totals since it started (prefix-cache hits, misses, evictions): they are
exported as counters, so `rate()` works and a restarted worker reads as a counter reset. Pages,
queue and batch are gauges. Every series is labelled by the worker's slot (`decode-0`, `decode-r1`:
stable across restarts, unlike its address) and its role; a worker that left the fleet leaves the
scrape with it.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_GAUGES = (  # (name, help, WorkerStats field)
    ("tandem_kv_pages_used", "KV pages held by requests (a prefill worker's pool holds its prefix cache)",
     "pages_used"),
    ("tandem_kv_pages_total", "KV pages in the pool", "pages_total"),
    ("tandem_kv_pages_held", "Prefill pool pages holding K/V for a decode worker to read (pull handoff)",
     "pages_held"),
    ("tandem_prefix_cache_pages", "Idle KV pages kept for reuse", "pages_cached"),
    ("tandem_worker_running", "Requests a worker is running (decode batch, or prompts queued for prefill)",
     "running"),
    ("tandem_worker_queued_tokens", "Prompt tokens waiting or in a pass on a prefill worker", "queued_tokens"),
    ("tandem_worker_lora_adapters", "LoRA adapters a worker holds (given at start, loaded, or unloaded and still "
     "serving a request)", "lora_adapters"),
)
_COUNTERS = (
    ("tandem_prefix_cache_hit_pages", "Prompt pages found in the prefix cache", "cache_hits"),
    ("tandem_prefix_cache_miss_pages", "Prompt pages looked up and not found", "cache_misses"),
    ("tandem_prefix_cache_evicted_pages", "Cached pages reclaimed for new requests", "cache_evictions"),
)


class WorkerCollector:
    """A prometheus_client collector over a fleet's workers (`watch(fleet)` once the fleet exists)."""

    def __init__(self):
        self.fleet = None

    def watch(self, fleet) -> None:
        self.fleet = fleet

    def collect(self):
        every = list(self.fleet.workers.values()) if self.fleet else []
        ready = GaugeMetricFamily("tandem_workers_ready", "Workers in routing (healthy, not draining)",
                                  labels=["role"])
        for role in sorted({w.role for w in every}):
            ready.add_metric([role], sum(w.routable for w in every if w.role == role))
        yield ready
        routable = GaugeMetricFamily("tandem_worker_routable", "1 while the worker is in routing; 0 while it is not "
                                     "ready (`tandem status` says why) or draining", labels=["worker", "role"])
        for w in every:
            routable.add_metric([w.slot, w.role], int(w.routable))
        yield routable
        workers = [w for w in every if w.stats is not None]
        for name, help_, field in _GAUGES:
            g = GaugeMetricFamily(name, help_, labels=["worker", "role"])
            for w in workers:
                if w.stats.pages_total or not field.startswith("pages"):  # pages: only of a worker with a pool
                    g.add_metric([w.slot, w.role], getattr(w.stats, field))
            yield g
        for name, help_, field in _COUNTERS:
            c = CounterMetricFamily(name, help_, labels=["worker", "role"])
            for w in workers:
                if w.stats.engine_salt:  # its prefix cache is on
                    c.add_metric([w.slot, w.role], getattr(w.stats, field))
            yield c
