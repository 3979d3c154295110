"""The OpenTelemetry side of tandem/tracing.py: the only module that imports opentelemetry (the `otel`
extra), and only when a process was configured to trace.

Each tracer has its own TracerProvider (none is installed globally): the orchestrator's and each
worker's spans carry a resource naming their process (`service.name`: the service name, suffixed by a
worker's role) and go out in batches over OTLP (protobuf, over HTTP or gRPC), or synchronously to the
SpanExporter a test hands in. Context crosses processes as a W3C traceparent string only.
"""

from __future__ import annotations

import asyncio
import os

from tandem.status import Status, status_of
from tandem.tracing import GRPC, Span, TraceConfig, TraceConfigError, Tracer

try:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.trace import StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as e:  # the extra is not installed
    raise TraceConfigError(f"tracing is configured but OpenTelemetry is not installed ({e.name} is missing): "
                           f"install Tandem with its otel extra (pip install -e '.[otel]') or unset the OTLP "
                           f"endpoint") from None

_PROPAGATOR = TraceContextTextMapPropagator()


def _attributes(attributes: dict) -> dict:
    """Tandem's attribute names are namespaced `tandem.`; None values are left out."""
    return {f"tandem.{k}": v for k, v in attributes.items() if v is not None}


def _otlp_exporter(config: TraceConfig):
    """The OTLP exporter of `config.protocol`: protobuf over HTTP, or over gRPC (plain text for an
    http:// endpoint, TLS for https://)."""
    if config.protocol == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=config.url, insecure=config.url.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.url)


class OtelSpan(Span):
    def __init__(self, tracer: "OtelTracer", span):
        self.tracer, self.span = tracer, span
        self.ended = False

    def traceparent(self) -> str:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.span))
        return carrier.get("traceparent", "")

    def set(self, **attributes) -> None:
        self.span.set_attributes(_attributes(attributes))

    def fail(self, error: BaseException) -> None:
        if self.ended:  # it ended well before (a stream closed after its last token)
            return
        cancelled = isinstance(error, (asyncio.CancelledError, GeneratorExit))
        status = Status.CANCELLED if cancelled else status_of(error)
        self.span.set_attribute("tandem.status", status.value)
        self.span.set_status(StatusCode.ERROR, str(error) or type(error).__name__)

    def end(self, end_ns: int | None = None) -> None:
        if not self.ended:
            self.ended = True
            self.span.end(end_time=end_ns)

    def child(self, name: str, start_ns: int | None = None, **attributes) -> Span:
        return self.tracer.start(name, self, start_ns, **attributes)

    def record(self, name: str, start_ns: int, end_ns: int, **attributes) -> None:
        self.tracer.record(name, self, start_ns, end_ns, **attributes)


class OtelTracer(Tracer):
    enabled = True

    def __init__(self, config: TraceConfig, exporter=None):
        """`exporter`: an SDK SpanExporter to use instead of OTLP to `config.url` (spans then go out one
        by one as they end, so a test sees them at once)."""
        resource = Resource.create({"service.name": config.service, "service.instance.id": str(os.getpid()),
                                    "tandem.role": config.role or "orchestrator"})
        self.provider = TracerProvider(resource=resource)
        if exporter is None:
            self.provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(config)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tandem")

    def _context(self, parent):
        if isinstance(parent, OtelSpan):
            return trace.set_span_in_context(parent.span)
        if isinstance(parent, str) and parent:
            return _PROPAGATOR.extract({"traceparent": parent})  # an invalid one starts a new trace
        return None

    def start(self, name: str, parent=None, start_ns: int | None = None, **attributes) -> Span:
        span = self.tracer.start_span(name, context=self._context(parent), start_time=start_ns,
                                      attributes=_attributes(attributes))
        return OtelSpan(self, span)

    def record(self, name: str, parent, start_ns: int, end_ns: int, **attributes) -> None:
        if not parent:
            return
        span = self.tracer.start_span(name, context=self._context(parent), start_time=start_ns,
                                      attributes=_attributes(attributes))
        span.end(end_time=max(end_ns, start_ns))

    def close(self) -> None:
        self.provider.shutdown()
