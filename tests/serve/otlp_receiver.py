"""Small real OTLP trace receivers for tests: over HTTP (`OtlpReceiver`: what OpenTelemetry exporters
POST to /v1/traces, a protobuf ExportTraceServiceRequest, maybe gzipped) and over gRPC
(`OtlpGrpcReceiver`: the collector's TraceService/Export). Each keeps every span, flattened. No
collector exists on this machine; these are the receiving ends of the same protocols."""

from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_id: str  # "" for a root span
    service: str  # the resource's service.name
    attributes: dict
    start_ns: int
    end_ns: int
    error: bool


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _spans(req: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                        resource.get("service.name", ""),
                                        {a.key: _value(a.value) for a in s.attributes}, s.start_time_unix_nano,
                                        s.end_time_unix_nano, s.status.code == 2))
    return out


class _Received:
    """The spans a receiver got, and waiting for them."""

    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        self.lock = threading.Lock()

    def add(self, req: ExportTraceServiceRequest) -> None:
        with self.lock:
            self.spans.extend(_spans(req))
            self.posts += 1

    def wait_for(self, done, timeout_s: float = 60.0) -> list[ReceivedSpan]:
        """The spans received, once `done(spans)` holds (or the timeout passed: the test then says what is missing)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


class OtlpReceiver(_Received):
    """`with OtlpReceiver() as r:` listens on 127.0.0.1 (a free port) at `r.url` until the block ends."""

    def __init__(self):
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver.add(req)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "OtlpReceiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class OtlpGrpcReceiver(_Received):
    """`with OtlpGrpcReceiver() as r:` serves OTLP's TraceService over plain-text gRPC on 127.0.0.1 (a free
    port) at `r.url` (http://host:port, as an OTLP/gRPC endpoint is written) until the block ends."""

    def __init__(self):
        super().__init__()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.add(request)
                return ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "OtlpGrpcReceiver":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(grace=None).wait()
