"""Prometheus metrics of the front door, in a registry of its own (no global state).

Conventions (what alerting and autoscaling need):
- every request-level series carries the served `model`; counters end in `_total`, durations are in
  seconds (Tandem's own) or microseconds (the `nv_inference_*` series of frontdoor/triton_metrics.py,
  named and labelled as Triton exports them, so Triton dashboards work against the front door); the
  load that schedulers and autoscalers read is in vLLM's names too (frontdoor/vllm_metrics.py);
- a request is counted from its arrival at the door: TTFT and queue time include tokenization and
  the wait for a worker, and a request refused at the door (429, 400, 503) is counted as a failure
  with its status;
- worker series (frontdoor/worker_metrics.py) are labelled by a stable slot name, not an address.

Latencies are measured where the client sees them; worker-side numbers (prefill compute, KV bytes and
seconds, pages, prefix cache) come from the workers' pushed stats.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from frontdoor.triton_metrics import TritonSeries
from frontdoor.vllm_metrics import VllmCollector
from frontdoor.worker_metrics import WorkerCollector
from tandem.request_context import api_key_name
from tandem.status import Status

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# Triton's failure reasons for nv_inference_request_failure
_TRITON_REASON = {Status.CANCELLED: "CANCELED", Status.RESOURCE_EXHAUSTED: "REJECTED",
                  Status.INVALID_ARGUMENT: "REJECTED", Status.UNAVAILABLE: "REJECTED"}


class Metrics:
    def __init__(self, mode: str, tokens_per_page: int = 0, model: str = "ensemble"):
        """`tokens_per_page`: the engines' KV page size, published so clients can turn tokens into pages."""
        self.registry = r = CollectorRegistry()
        self.mode, self.model = mode, model
        Gauge("tandem_kv_tokens_per_page", "Tokens one KV page holds", registry=r).set(tokens_per_page)
        m = ["model"]
        self.ttft = Histogram("tandem_ttft_seconds", "Arrival at the door to first token", m + ["mode"],
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("tandem_itl_seconds", "Gap between consecutive streamed tokens", m + ["mode"],
                             buckets=_TOKEN, registry=r)
        self.tpot = Histogram("tandem_tpot_seconds", "Time per output token after the first, per request",
                              m + ["mode"], buckets=_TOKEN, registry=r)
        self.e2e = Histogram("tandem_e2e_seconds", "Arrival at the door to last token", m + ["mode"],
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
                                 "finishing after prefill compute; pull, first token to the decode worker's read done; "
                                 "trtllm, first token to the decode worker's first (an upper bound)",
                                 ["handoff"], buckets=_LATENCY, registry=r)
        self.in_flight = Gauge("tandem_requests_in_flight", "Requests admitted and being served", m, registry=r)
        self.waiting = Gauge("tandem_requests_waiting", "Requests arrived and not yet streaming: being "
                             "tokenized, or waiting for a worker's first token", m, registry=r)
        self.requests = Counter("tandem_worker_requests", "Requests sent to a worker", ["worker", "role"], registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of admitted requests", m, registry=r)
        self.tokens = Counter("tandem_output_tokens", "Tokens streamed to clients", m + ["mode"], registry=r)
        # by caller: the name of the API key a request came with (frontdoor/api_keys.py); only with keys
        self.key_prompt_tokens = Counter("tandem_api_key_prompt_tokens", "Prompt tokens of admitted requests, "
                                         "by the name of their API key", ["api_key"], registry=r)
        self.key_output_tokens = Counter("tandem_api_key_output_tokens", "Tokens streamed to clients, by the name "
                                         "of their API key", ["api_key"], registry=r)
        self.finished = Counter("tandem_request_finished", "Requests that ended with a finish reason "
                                "(stop, length)", m + ["reason"], registry=r)
        self.failures = Counter("tandem_request_failures", "Requests that ended in an error, refusals at the "
                                "door included, by status", m + ["status"], registry=r)
        self.recoveries = Counter("tandem_recoveries", "Requests resumed on another worker after a failure",
                                  ["role"], registry=r)
        self.preemptions = Counter("tandem_preemptions", "Requests that gave their pages to a more urgent one "
                                   "(priority scheduling) and resumed", registry=r)
        self.local_prefills = Counter("tandem_local_prefills", "Requests a decode worker prefilled itself "
                                      "(conditional disaggregation: it lacked few enough prompt tokens)", ["worker"],
                                      registry=r)
        self._zero_series()
        self.triton = TritonSeries(model)
        self.workers = WorkerCollector()
        r.register(self.workers)
        self.vllm = VllmCollector(model, tokens_per_page, self.workers, {
            "vllm:time_to_first_token_seconds": self.ttft, "vllm:inter_token_latency_seconds": self.itl,
            "vllm:request_time_per_output_token_seconds": self.tpot, "vllm:e2e_request_latency_seconds": self.e2e,
            "vllm:prompt_tokens": self.prompt_tokens, "vllm:generation_tokens": self.tokens,
            "vllm:request_success": self.finished})
        r.register(self.vllm)

    def _zero_series(self) -> None:
        """Export the served model's request series at 0 from the start: a counter first seen at 1 gives
        `rate()` nothing to compare with (the first refusals would not count), and an absent gauge
        leaves dashboard panels and alerts empty instead of reading 0."""
        for metric in (self.in_flight, self.waiting, self.prompt_tokens):
            metric.labels(self.model)
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.tokens):
            metric.labels(self.model, self.mode)
        for reason in ("stop", "length"):
            self.finished.labels(self.model, reason)
        for status in Status:
            if status is not Status.OK:
                self.failures.labels(self.model, status.value)

    def start(self, arrived: float) -> "RequestMeter":
        """The meter of a request that reached the door at `arrived` (time.perf_counter()) and now asks
        to be served; it counts as waiting until its first token."""
        return RequestMeter(self, arrived)

    def refused(self, status: Status) -> None:
        """A request refused before it was served: at the HTTP gate (overload 429) or while it was
        prepared (draining, over a limit, invalid)."""
        self.failures.labels(self.model, status.value).inc()
        self.triton.fail(_TRITON_REASON.get(status, "OTHER"))

    def record_prefill(self, worker: str, t) -> None:
        """Worker-side timings of one prefill (an control.handoff.Timings with its Prefilled reply)."""
        p = t.prefilled
        self.queue.labels("decode").observe(t.reserved - t.start)
        self.queue.labels("prefill").observe(p.queue_seconds)
        self.prefill.labels(worker).observe(p.compute_seconds)
        self.kv_bytes.labels(worker, t.transport).inc(p.kv_bytes)
        self.kv_seconds.labels(worker).observe(p.kv_seconds)
        if t.transport != "trtllm" and p.source is None and not p.finish_reason:
            self.kv_wait.labels("push").observe(p.kv_seconds)

    def record_pull(self, decode: str, t) -> None:
        """The decode side of a pull handoff (a control.handoff.Timings whose Pulled arrived). TensorRT-LLM
        (transport "trtllm"): first token to the decode worker's first token, an upper bound of its wait
        (it includes one decode step); the bytes move inside TensorRT-LLM, unseen."""
        if t.transport == "trtllm":
            self.kv_wait.labels("trtllm").observe(t.pulled_at - t.first_token)
            return
        self.kv_wait.labels("pull").observe(t.pulled_at - t.first_token)
        self.kv_bytes.labels(decode, t.transport).inc(t.pulled.kv_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry) + self.triton.render()


class RequestMeter:
    """One request's measurements, from its arrival at the door to its end: the first of `done` or
    `failed` ends it (later calls do nothing); `admitted` at most once, before its tokens."""

    def __init__(self, metrics: Metrics, arrived: float):
        self.m, self.t0 = metrics, arrived
        name = api_key_name()  # the caller, when the doors take keys: its tokens are counted under its name
        self.by_key = (metrics.key_prompt_tokens.labels(name), metrics.key_output_tokens.labels(name)) if name else None
        self.first = self.last = None
        self.tokens, self.streaming, self.ended = 0, False, False
        self.m.waiting.labels(self.m.model).inc()
        self.m.vllm.waiting += 1
        self.m.triton.add("nv_inference_pending_request_count")

    def admitted(self, prompt_tokens: int) -> None:
        self.m.in_flight.labels(self.m.model).inc()
        self.m.prompt_tokens.labels(self.m.model).inc(prompt_tokens)
        if self.by_key:
            self.by_key[0].inc(prompt_tokens)
        self.streaming = True

    def token(self) -> bool:
        """A token streamed; True for the first."""
        m, now = self.m, time.perf_counter()
        self.tokens += 1
        m.tokens.labels(m.model, m.mode).inc()
        if self.by_key:
            self.by_key[1].inc()
        if self.first is None:
            self.first = now
            m.ttft.labels(m.model, m.mode).observe(now - self.t0)
            m.waiting.labels(m.model).dec()
            m.vllm.waiting, m.vllm.running = m.vllm.waiting - 1, m.vllm.running + 1
            m.triton.add("nv_inference_pending_request_count", -1)
            m.triton.add("nv_inference_queue_duration_us", (now - self.t0) * 1e6)
        else:
            m.itl.labels(m.model, m.mode).observe(now - self.last)
        self.last = now
        return self.tokens == 1

    def done(self, reason: str) -> None:
        """The request ended with finish reason `reason` (its last token streamed)."""
        if self._end():
            return
        m, end = self.m, time.perf_counter()
        m.finished.labels(m.model, reason).inc()
        m.e2e.labels(m.model, m.mode).observe(end - self.t0)
        if self.tokens > 1:
            m.tpot.labels(m.model, m.mode).observe((end - self.first) / (self.tokens - 1))
        for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count"):
            m.triton.add(name)
        m.triton.add("nv_inference_request_duration_us", (end - self.t0) * 1e6)

    def failed(self, status: Status) -> None:
        """The request ended in an error with `status` (a refusal at the door included)."""
        if self._end():
            return
        m = self.m
        m.failures.labels(m.model, status.value).inc()
        m.triton.fail(_TRITON_REASON.get(status, "BACKEND"))

    def _end(self) -> bool:
        """Leave the gauges; True if the request had already ended."""
        if self.ended:
            return True
        self.ended = True
        m = self.m
        if self.first is None:
            m.waiting.labels(m.model).dec()
            m.vllm.waiting -= 1
            m.triton.add("nv_inference_pending_request_count", -1)
        else:
            m.vllm.running -= 1
        if self.streaming:
            m.in_flight.labels(m.model).dec()
        return False
