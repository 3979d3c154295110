"""Traces of requests, OpenTelemetry when it is configured and nothing at all when it is not.

The small API every process uses (the orchestrator, and the workers inside Triton):

    tracer = make_tracer(TraceConfig.from_env(os.environ, role="prefill"))   # NOOP when not configured
    span = tracer.start("tandem.request", parent=incoming_traceparent, route="/v1/completions")
    child = span.child("tandem.admission")        # a live span; `with child:` ends it (errors marked)
    msg = Prefill(..., traceparent=child.traceparent())   # W3C traceparent: the context crosses processes
    tracer.record("tandem.prefill.compute", msg.traceparent, start_ns, end_ns, tokens=12)  # a finished span

Off by default: `TraceConfig.from_env` returns None unless an OTLP endpoint is given (`--otlp-endpoint`
/ TANDEM_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT) or
OTEL_TRACES_EXPORTER=otlp asks for the default one; OTEL_TRACES_EXPORTER=none and OTEL_SDK_DISABLED=true
switch it off. Without a config, `make_tracer` returns NOOP, whose spans do nothing, and opentelemetry is
never imported (tandem/otel_tracer.py holds everything that imports it).

Times are wall-clock nanoseconds (`time.time_ns()`); `ns_at(t)` turns a `time.perf_counter()` reading
taken earlier in this process into one, so spans can be made from timings measured anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Mapping

HTTP, GRPC = "http/protobuf", "grpc"
DEFAULT_ENDPOINTS = {HTTP: "http://localhost:4318", GRPC: "http://localhost:4317"}  # the specification's
TRACES_PATH = "/v1/traces"
EXPORTERS = ("otlp", "none")
PROTOCOLS = tuple(DEFAULT_ENDPOINTS)


class TraceConfigError(ValueError):
    """The tracing settings are invalid; the message names the variable and what is allowed."""


def traces_url(endpoint: str, protocol: str = HTTP) -> str:
    """An OTLP base URL as OTEL_EXPORTER_OTLP_ENDPOINT gives it, turned into where traces go: over HTTP
    the traces URL (one that already ends in /v1/traces is kept as it is); over gRPC the URL itself
    (http:// for plain text, https:// for TLS)."""
    if not endpoint.startswith(("http://", "https://")):
        raise TraceConfigError(f"OTLP endpoint {endpoint!r} must be an http:// or https:// URL "
                               f"(e.g. {DEFAULT_ENDPOINTS[protocol]} for OTLP over {protocol})")
    url = endpoint.rstrip("/")
    return url if protocol == GRPC or url.endswith(TRACES_PATH) else url + TRACES_PATH


@dataclass(frozen=True)
class TraceConfig:
    """Where a process exports its spans (OTLP, protobuf over HTTP or gRPC) and the service it reports as."""

    url: str  # the traces URL, e.g. http://127.0.0.1:4318/v1/traces (gRPC: the collector's, http://h:4317)
    service_name: str = "tandem"
    role: str = ""  # "" for the orchestrator; prefill / decode / generate for a worker
    protocol: str = HTTP  # HTTP or GRPC (OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL)

    @property
    def service(self) -> str:
        """What the spans' resource calls the process: the service name, suffixed by a worker's role."""
        return f"{self.service_name}-{self.role}" if self.role else self.service_name

    @classmethod
    def from_env(cls, env: Mapping[str, str], endpoint: str | None = None, role: str = "") -> "TraceConfig | None":
        """The configuration `env` (and an `endpoint` flag, which wins) asks for; None: tracing is off."""
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        if exporter and exporter not in EXPORTERS:
            raise TraceConfigError(f"OTEL_TRACES_EXPORTER={exporter!r} is not supported; allowed: "
                                   f"{', '.join(EXPORTERS)}")
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                    or HTTP).strip()
        if protocol not in PROTOCOLS:
            raise TraceConfigError(f"OTLP protocol {protocol!r} is not supported; allowed: {', '.join(PROTOCOLS)}")
        if exporter == "none":
            return None
        if endpoint or env.get("TANDEM_OTLP_ENDPOINT"):
            url = traces_url(endpoint or env["TANDEM_OTLP_ENDPOINT"], protocol)
        elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            url = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]  # the signal's own URL, used as given
            traces_url(url, protocol)  # (checked only)
        elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            url = traces_url(env["OTEL_EXPORTER_OTLP_ENDPOINT"], protocol)
        elif exporter == "otlp":
            url = traces_url(DEFAULT_ENDPOINTS[protocol], protocol)
        else:
            return None
        return cls(url, env.get("OTEL_SERVICE_NAME", "").strip() or "tandem", role, protocol)

    def worker_env(self) -> dict[str, str]:
        """What a worker process (Triton's python stubs) needs in its environment to export the same way."""
        return {"TANDEM_OTLP_ENDPOINT": self.url, "OTEL_SERVICE_NAME": self.service_name,
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": self.protocol}


def ns_at(perf_t: float) -> int:
    """Wall-clock nanoseconds of an earlier `time.perf_counter()` reading `perf_t` of this process."""
    return time.time_ns() - int((time.perf_counter() - perf_t) * 1e9)


class Span:
    """A span that records nothing (tracing off). The OpenTelemetry one has the same methods."""

    def traceparent(self) -> str:
        """The W3C traceparent naming this span as the parent of spans elsewhere ("" when off)."""
        return ""

    def set(self, **attributes) -> None:
        """Add attributes (names without the `tandem.` prefix; values str, bool, int or float)."""

    def fail(self, error: BaseException) -> None:
        """Mark the span failed by `error` (its status and message); nothing once it has ended."""

    def end(self, end_ns: int | None = None) -> None:
        """End the span now, or at `end_ns`. Ending twice does nothing."""

    def child(self, name: str, start_ns: int | None = None, **attributes) -> "Span":
        """A live span under this one, started now or at `start_ns`."""
        return self

    def record(self, name: str, start_ns: int, end_ns: int, **attributes) -> None:
        """A finished span under this one, from `start_ns` to `end_ns`."""

    def __enter__(self) -> "Span":
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is not None:
            self.fail(error)
        self.end()


class Tracer:
    """Makes spans (this one: spans that record nothing). `parent` is a W3C traceparent string (from a
    wire message or a client's header), a Span of this tracer, or None/"" for a new trace."""

    enabled = False

    def start(self, name: str, parent: "str | Span | None" = None, start_ns: int | None = None, **attributes) -> Span:
        return NO_SPAN

    def record(self, name: str, parent: "str | Span | None", start_ns: int, end_ns: int, **attributes) -> None:
        """A finished span under `parent`; with no parent it is not recorded (nothing asked for a trace)."""

    def close(self) -> None:
        """Export what is buffered and stop (a process that ends)."""


NO_SPAN = Span()
NOOP = Tracer()


def make_tracer(config: TraceConfig | None, exporter=None) -> Tracer:
    """The tracer for `config`: NOOP when it is None, else OpenTelemetry exporting OTLP to its URL
    (or to `exporter`, an SDK SpanExporter, e.g. the in-memory one in tests). Needs the `otel` extra."""
    if config is None:
        return NOOP
    from tandem.otel_tracer import OtelTracer  # only here: tracing off never imports opentelemetry

    return OtelTracer(config, exporter)
