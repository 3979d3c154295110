"""Prometheus metrics of the orchestrator, in a registry of its own (no global state).

Latencies are measured where the client sees them (the front door), per request and per token;
worker-side numbers (prefill compute, KV bytes and seconds, decode pages) come from the workers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, mode: str, tokens_per_page: int = 0):
        """`tokens_per_page`: the engines' KV page size, published so clients can turn tokens into pages."""
        self.registry = r = CollectorRegistry()
        self.mode = mode
        Gauge("tandem_kv_tokens_per_page", "Tokens one KV page holds", registry=r).set(tokens_per_page)
        self.ttft = Histogram("tandem_ttft_seconds", "Time to first token", ["mode"], buckets=_LATENCY, registry=r)
        self.itl = Histogram("tandem_itl_seconds", "Gap between consecutive streamed tokens", ["mode"],
                             buckets=_TOKEN, registry=r)
        self.tpot = Histogram("tandem_tpot_seconds", "Time per output token after the first, per request", ["mode"],
                              buckets=_TOKEN, registry=r)
        self.e2e = Histogram("tandem_e2e_seconds", "Request latency, arrival to last token", ["mode"],
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("tandem_queue_seconds", "Time waiting for a worker", ["role"], buckets=_LATENCY,
                               registry=r)
        self.prefill = Histogram("tandem_prefill_seconds", "Prefill compute per request", ["worker"],
                                 buckets=_LATENCY, registry=r)
        self.kv_bytes = Counter("tandem_kv_transfer_bytes", "KV bytes handed from prefill to decode",
                                ["worker", "transport"], registry=r)
        self.kv_seconds = Histogram("tandem_kv_transfer_seconds", "Wait for the KV handoff after prefill compute",
                                    ["worker"], buckets=_TOKEN, registry=r)
        self.kv_wait = Histogram("tandem_kv_wait_seconds", "Decode-side wait for the KV: push, the writes "
                                 "finishing after prefill compute; pull, first token to the decode worker's read done",
                                 ["handoff"], buckets=_LATENCY, registry=r)
        self.pages_used = Gauge("tandem_kv_pages_used", "KV pages held by requests (a prefill worker's pool holds its prefix cache)", ["worker"], registry=r)
        self.pages_total = Gauge("tandem_kv_pages_total", "KV pages in the pool", ["worker"], registry=r)
        self.in_flight = Gauge("tandem_requests_in_flight", "Requests being served", registry=r)
        self.requests = Counter("tandem_worker_requests", "Requests sent to a worker", ["worker", "role"], registry=r)
        self.tokens = Counter("tandem_output_tokens", "Tokens streamed to clients", ["mode"], registry=r)
        self.failures = Counter("tandem_request_failures", "Requests that ended in an error, by status", ["status"],
                                registry=r)
        self.recoveries = Counter("tandem_recoveries", "Requests resumed on another worker after a failure",
                                  ["role"], registry=r)
        self.workers_ready = Gauge("tandem_workers_ready", "Workers in routing", ["role"], registry=r)
        self.local_prefills = Counter("tandem_local_prefills", "Requests a decode worker prefilled itself "
                                      "(conditional disaggregation: it lacked few enough prompt tokens)", ["worker"],
                                      registry=r)
        # prefix cache, as each worker reports it (running totals since the worker started)
        self.cache_pages = Gauge("tandem_prefix_cache_pages", "Idle KV pages kept for reuse", ["worker"], registry=r)
        self.cache_hits = Gauge("tandem_prefix_cache_hit_pages", "Prompt pages found in the prefix cache",
                                ["worker"], registry=r)
        self.cache_misses = Gauge("tandem_prefix_cache_miss_pages", "Prompt pages looked up and not found",
                                  ["worker"], registry=r)
        self.cache_evictions = Gauge("tandem_prefix_cache_evicted_pages", "Cached pages reclaimed for new requests",
                                     ["worker"], registry=r)
        self.cache_hit_rate = Gauge("tandem_prefix_cache_hit_rate", "Hit pages / looked-up pages", ["worker"],
                                    registry=r)

    def record_prefill(self, worker: str, t) -> None:
        """Worker-side timings of one prefill (an control.handoff.Timings with its Prefilled reply)."""
        p = t.prefilled
        self.queue.labels("decode").observe(t.reserved - t.start)
        self.queue.labels("prefill").observe(p.queue_seconds)
        self.prefill.labels(worker).observe(p.compute_seconds)
        self.kv_bytes.labels(worker, t.transport).inc(p.kv_bytes)
        self.kv_seconds.labels(worker).observe(p.kv_seconds)
        if p.source is None and not p.finish_reason:
            self.kv_wait.labels("push").observe(p.kv_seconds)

    def record_pull(self, decode: str, t) -> None:
        """The decode side of a pull handoff (an control.handoff.Timings whose Pulled arrived)."""
        self.kv_wait.labels("pull").observe(t.pulled_at - t.first_token)
        self.kv_bytes.labels(decode, t.transport).inc(t.pulled.kv_bytes)

    def record_worker(self, w) -> None:
        """A worker's pushed stats (an control.fleet.WorkerState)."""
        s = w.stats
        if s is not None and s.pages_total:
            self.pages_used.labels(w.name).set(s.pages_used)
            self.pages_total.labels(w.name).set(s.pages_total)
        if s is not None and s.cache_salt:
            looked = s.cache_hits + s.cache_misses
            self.cache_pages.labels(w.name).set(s.pages_cached)
            self.cache_hits.labels(w.name).set(s.cache_hits)
            self.cache_misses.labels(w.name).set(s.cache_misses)
            self.cache_evictions.labels(w.name).set(s.cache_evictions)
            self.cache_hit_rate.labels(w.name).set(s.cache_hits / looked if looked else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
