"""The served model's `nv_inference_*` series, named, typed and labelled as Triton exports them, so
Triton dashboards and alerts read the front door as they read a Triton server.

Triton's counters carry no `_total` suffix, which prometheus_client would add to every counter it
renders; these few series are therefore kept and rendered here, in the Prometheus text format.
"""

from __future__ import annotations

import threading

# (name, type, help); counters of Triton's "Per Request" kind, and the pending-request gauge
SERIES = (
    ("nv_inference_request_success", "counter", "Number of successful inference requests, all batch sizes"),
    ("nv_inference_request_failure", "counter", "Number of failed inference requests, all batch sizes"),
    ("nv_inference_count", "counter", "Number of inferences performed (does not include cached requests)"),
    ("nv_inference_exec_count", "counter", "Number of model executions performed (does not include cached "
     "requests)"),
    ("nv_inference_request_duration_us", "counter", "Cumulative inference request duration in microseconds "
     "(includes cached requests)"),
    ("nv_inference_queue_duration_us", "counter", "Cumulative inference queuing duration in microseconds "
     "(arrival to first token)"),
    ("nv_inference_pending_request_count", "gauge", "Instantaneous number of pending requests awaiting "
     "execution per-model."),
)
REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")  # nv_inference_request_failure's `reason`


class TritonSeries:
    """The values of one served model (version "1"); thread-safe, rendered on every scrape."""

    def __init__(self, model: str):
        self.labels = f'model="{_escape(model)}",version="1"'
        self.values = {name: 0.0 for name, _, _ in SERIES if name != "nv_inference_request_failure"}
        self.failures = dict.fromkeys(REASONS, 0.0)
        self.lock = threading.Lock()

    def add(self, name: str, amount: float = 1.0) -> None:
        with self.lock:
            self.values[name] += amount

    def fail(self, reason: str) -> None:
        with self.lock:
            self.failures[reason] += 1

    def render(self) -> bytes:
        lines = []
        with self.lock:
            for name, kind, help_ in SERIES:
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                if name == "nv_inference_request_failure":
                    lines += [f'{name}{{{self.labels},reason="{r}"}} {v}' for r, v in self.failures.items()]
                else:
                    lines.append(f"{name}{{{self.labels}}} {self.values[name]}")
        return ("\n".join(lines) + "\n").encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
