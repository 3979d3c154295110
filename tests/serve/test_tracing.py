"""OpenTelemetry traces of one disaggregated request across the orchestrator and its real Triton workers.

The workers export OTLP (HTTP, or gRPC) to a real receiver run by the test (tests/serve/otlp_receiver.py); the
orchestrator exports to the SDK's in-memory exporter when the stack runs in this process, or OTLP too
when `tandem serve --otlp-endpoint` runs it. One trace per request, the client's traceparent its parent,
and the parent-child links cross the process boundaries through the wire messages' traceparent."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import urllib.request

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra (scripts/setup installs it)")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from tandem.manifest import read_manifest  # noqa: E402
from tandem.tracing import NOOP, TraceConfig, TraceConfigError, make_tracer  # noqa: E402
from tests.conftest import leak_check, leak_snapshot, start_serve, stop_serve  # noqa: E402
from tests.serve.otlp_receiver import OtlpGrpcReceiver, OtlpReceiver, ReceivedSpan  # noqa: E402

WORKER_SPANS = {"tandem-prefill": {"tandem.prefill.queue", "tandem.prefill.compute"}, "tandem-decode": {"tandem.decode"}}
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "200"}  # the workers' batches go out every 200 ms, not 5 s


def client_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def from_sdk(s) -> ReceivedSpan:
    """An in-memory exporter's span in the receiver's flat form."""
    return ReceivedSpan(s.name, f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}",
                        f"{s.parent.span_id:016x}" if s.parent else "", s.resource.attributes["service.name"],
                        dict(s.attributes), s.start_time, s.end_time, s.status.status_code.name == "ERROR")


def complete(http: str, prompt: str, max_tokens: int, traceparent: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{http}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "traceparent": traceparent})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def workers_reported(trace_id: str, extra: set[str] = frozenset()):
    def done(spans: list[ReceivedSpan]) -> bool:
        have = {s.name for s in spans if s.trace_id == trace_id}
        return set().union(*WORKER_SPANS.values(), extra) <= have
    return done


def one(spans: list[ReceivedSpan], name: str, service: str | None = None) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and (service is None or s.service == service)]
    assert len(found) == 1, f"{name} ({service}): {len(found)} spans among {sorted(s.name for s in spans)}"
    return found[0]


def check_request_trace(spans: list[ReceivedSpan], trace_id: str, client_span: str, completion_tokens: int,
                        layout) -> dict[str, ReceivedSpan]:
    """What every traced disaggregated request shows, push or pull; returns the spans by name."""
    mine = [s for s in spans if s.trace_id == trace_id]
    assert len({s.trace_id for s in mine}) == 1 and not [s for s in mine if s.error]
    by = {s.name: s for s in mine}
    request = one(mine, "tandem.request", "tandem")
    assert request.parent_id == client_span  # the client's traceparent is honoured
    assert one(mine, "tandem.admission").parent_id == request.span_id
    assert one(mine, "tandem.tokenize").parent_id == by["tandem.admission"].span_id
    stream = one(mine, "tandem.stream")
    assert stream.parent_id == request.span_id
    assert stream.attributes["tandem.completion_tokens"] == completion_tokens
    attempt = one(mine, "tandem.attempt")
    assert attempt.parent_id == stream.span_id and attempt.attributes["tandem.resumed"] is False
    assert attempt.attributes["tandem.decode_worker"] == "decode-0"
    assert attempt.attributes["tandem.prefill_worker"] == "prefill-0"
    prefill = one(mine, "tandem.prefill", "tandem")
    reservation = one(mine, "tandem.decode_reservation", "tandem")
    assert prefill.parent_id == reservation.parent_id == attempt.span_id
    # across processes: the prefill worker's spans under the orchestrator's prefill span ...
    for name in WORKER_SPANS["tandem-prefill"]:
        assert one(mine, name, "tandem-prefill").parent_id == prefill.span_id
    queue, compute = by["tandem.prefill.queue"], by["tandem.prefill.compute"]
    assert queue.end_ns == compute.start_ns and prefill.start_ns <= queue.start_ns <= compute.end_ns <= prefill.end_ns
    prompt_tokens = request.attributes["tandem.prompt_tokens"]
    assert compute.attributes["tandem.tokens"] == prompt_tokens
    # ... and the decode worker's under the attempt
    decode = one(mine, "tandem.decode", "tandem-decode")
    assert decode.parent_id == attempt.span_id
    assert decode.attributes["tandem.output_tokens"] == completion_tokens
    assert decode.attributes["tandem.finish_reason"] == "length"
    moved = prompt_tokens - reservation.attributes["tandem.cached_tokens"]  # K/V the decode worker lacked
    if attempt.attributes["tandem.handoff"] == "push":  # the writer writes the positions
        assert by["tandem.prefill"].attributes["tandem.kv_bytes"] == moved * layout.bytes_per_token > 0
    else:  # the reader reads whole pages
        pages = -(-moved // layout.tokens_per_page)
        assert by["tandem.decode_reservation"].attributes["tandem.kv_bytes"] == pages * layout.tokens_per_page * layout.bytes_per_token > 0
    return by


def test_push_trace_in_memory_orchestrator_and_otlp_workers(built_engines, tmp_path, monkeypatch):
    """The stack in this process: the orchestrator's spans in the SDK's in-memory exporter, the workers'
    through OTLP/HTTP to the receiver, joined into one trace by the wire messages' traceparent."""
    from ops.deployment import Deployment
    from ops.stack import Stack
    from ops.triton_process import free_port

    for k, v in FAST_EXPORT.items():
        monkeypatch.setenv(k, v)
    before = leak_snapshot()
    memory = InMemorySpanExporter()
    traceparent, trace_id, client_span = client_traceparent()
    layout = read_manifest(str(built_engines / "decode")).kv_layout
    with OtlpReceiver() as receiver:
        dep = Deployment(engines=str(built_engines), kv_pool_bytes=256 << 20, tracing={"otlp_endpoint": receiver.url},
                         front_door={"grpc_port": free_port(), "http_port": free_port()})
        tracer = make_tracer(TraceConfig(receiver.url + "/v1/traces"), exporter=memory)
        stack = Stack(dep, str(tmp_path), log=lambda *_: None, tracer=tracer)

        async def run():
            await stack.start()
            try:
                loop = asyncio.get_running_loop()
                answer = await loop.run_in_executor(None, complete, f"http://127.0.0.1:{dep.front_door.http_port}",
                                                    "The capital of France is", 6, traceparent)
                spans = await loop.run_in_executor(None, receiver.wait_for,
                                                   workers_reported(trace_id, {"tandem.kv_transfer"}))
                return answer, spans
            finally:
                await stack.stop()

        answer, worker_spans = asyncio.run(run())
    tracer.close()
    assert leak_check(before) == []
    assert answer["usage"]["completion_tokens"] == 6
    orchestrator = [from_sdk(s) for s in memory.get_finished_spans()]
    assert {s.service for s in orchestrator} == {"tandem"}
    assert {s.service for s in worker_spans} == {"tandem-prefill", "tandem-decode"}
    by = check_request_trace(orchestrator + worker_spans, trace_id, client_span, 6, layout)
    kv = one(worker_spans, "tandem.kv_transfer", "tandem-prefill")
    assert kv.parent_id == by["tandem.prefill"].span_id
    assert kv.attributes["tandem.direction"] == "push" and kv.attributes["tandem.transport"] == "shm"
    assert kv.attributes["tandem.bytes"] == by["tandem.prefill"].attributes["tandem.kv_bytes"] > 0
    assert by["tandem.decode_reservation"].attributes["tandem.transport"] == "shm"


def test_pull_trace_from_tandem_serve_all_over_otlp(built_engines, tmp_path):
    """`tandem serve --otlp-endpoint`: the flag reaches the workers (by environment) and every process
    exports OTLP/HTTP; the pull handoff's read is the decode worker's kv_transfer span."""
    import tritonclient.grpc as grpcclient

    from tests.serve.clients import ensemble_inputs

    traceparent, trace_id, client_span = client_traceparent()
    by_grpc, grpc_trace, grpc_span = client_traceparent()
    layout = read_manifest(str(built_engines / "decode")).kv_layout
    with OtlpReceiver() as receiver:
        s = start_serve(built_engines, tmp_path, "--handoff", "pull", "--otlp-endpoint", receiver.url, env=FAST_EXPORT)
        try:
            answer = complete(s.http, "Once upon a time, in a small village,", 5, traceparent)
            client = grpcclient.InferenceServerClient(s.grpc)
            try:  # the gRPC door honours the same traceparent, as metadata
                client.infer("ensemble", ensemble_inputs(grpcclient, "Hello", 2, False), headers={"traceparent": by_grpc})
            finally:
                client.close()
            spans = receiver.wait_for(lambda got: workers_reported(trace_id, {"tandem.kv_transfer"})(got) and
                                      {trace_id, grpc_trace} <= {x.trace_id for x in got if x.name == "tandem.request"})
        finally:
            stop_serve(s)
    assert one([x for x in spans if x.trace_id == grpc_trace], "tandem.request").parent_id == grpc_span
    assert answer["usage"]["completion_tokens"] == 5
    assert {x.service for x in spans if x.trace_id == trace_id} == {"tandem", "tandem-prefill", "tandem-decode"}
    by = check_request_trace(spans, trace_id, client_span, 5, layout)
    read = one([x for x in spans if x.trace_id == trace_id], "tandem.kv_transfer", "tandem-decode")
    assert read.parent_id == by["tandem.attempt"].span_id
    assert read.attributes["tandem.direction"] == "pull" and read.attributes["tandem.transport"] == "shm"
    assert read.attributes["tandem.bytes"] == by["tandem.decode_reservation"].attributes["tandem.kv_bytes"] > 0
    assert by["tandem.attempt"].attributes["tandem.handoff"] == "pull"


def test_tracing_is_off_and_opentelemetry_unimported_by_default():
    code = ("import os, sys\n"
            "import ops.stack, frontdoor.core, frontdoor.http_app, frontdoor.grpc_door, control.serving_path, cli.main\n"
            "from tandem.tracing import TraceConfig, make_tracer, NOOP\n"
            "env = {k: v for k, v in os.environ.items() if not k.startswith(('OTEL_', 'TANDEM_OTLP'))}\n"
            "assert make_tracer(TraceConfig.from_env(env)) is NOOP\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TANDEM_OTLP"))})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_configuration_follows_the_flag_then_the_standard_variables():
    assert TraceConfig.from_env({}) is None
    assert TraceConfig.from_env({"OTEL_SERVICE_NAME": "x"}) is None  # a name alone asks for nothing
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}
    assert TraceConfig.from_env(base).url == "http://collector:4318/v1/traces"
    assert TraceConfig.from_env({**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x"}).url == "http://t:1/x"
    flagged = TraceConfig.from_env({**base, "OTEL_SERVICE_NAME": "llm"}, "http://127.0.0.1:9/v1/traces", role="decode")
    assert (flagged.url, flagged.service) == ("http://127.0.0.1:9/v1/traces", "llm-decode")
    assert TraceConfig.from_env({"TANDEM_OTLP_ENDPOINT": "https://h:1"}).url == "https://h:1/v1/traces"
    assert TraceConfig.from_env({"OTEL_TRACES_EXPORTER": "otlp"}).url == "http://localhost:4318/v1/traces"
    assert TraceConfig.from_env({**base, "OTEL_TRACES_EXPORTER": "none"}) is None
    grpc = TraceConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317/", "OTEL_EXPORTER_OTLP_PROTOCOL":
                                 "grpc"}, role="prefill")
    assert (grpc.url, grpc.protocol) == ("http://collector:4317", "grpc")  # gRPC: no /v1/traces path
    assert grpc.worker_env()["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"
    assert TraceConfig.from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}).url \
        == "http://localhost:4317"
    assert TraceConfig.from_env({**base, "OTEL_SDK_DISABLED": "true"}) is None
    assert make_tracer(None) is NOOP
    for env, named in (({"OTEL_TRACES_EXPORTER": "zipkin"}, "allowed: otlp, none"),
                       ({**base, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "allowed: http/protobuf, grpc"),
                       ({"TANDEM_OTLP_ENDPOINT": "collector:4318"}, "http:// or https://")):
        with pytest.raises(TraceConfigError, match=named):
            TraceConfig.from_env(env)


def test_a_resumed_attempt_is_its_own_span_after_the_failed_one():
    """Unit level (a decode worker killed mid-stream, for real, is tests/serve/test_2p2d.py's): the serving
    path's own run loop with scripted attempts, the first failing UNAVAILABLE after two tokens."""
    import time
    from types import SimpleNamespace

    from control.fleet import Fleet, WorkerState
    from control.handoff import Attempt
    from control.router import ROUTERS
    from control.serving_path import ServingPath
    from frontdoor.door_metrics import Metrics
    from tandem.status import Unavailable
    from tandem.wire import Token

    class Scripted(Attempt):
        def __init__(self, worker, request_id, span, tokens: list[int], then_fail: bool):
            super().__init__(worker, request_id, span)
            self.tokens, self.then_fail = tokens, then_fail

        async def next(self):
            if self.tokens:
                token = self.tokens.pop(0)
                return Token(token, finish_reason=None if self.tokens or self.then_fail else "length")
            if self.then_fail:
                raise Unavailable("decode-0 went away mid-stream")
            return None

    class TwoTries(ServingPath):
        roles = ("decode",)

        def attempt(self, prep, sent, avoid, request_id, span=None):
            worker = WorkerState(f"decode-{1 if sent else 0}", "decode", "127.0.0.1:1", None)
            return Scripted(worker, request_id, span, [3] if sent else [1, 2], then_fail=not sent)

    memory = InMemorySpanExporter()
    tracer = make_tracer(TraceConfig("http://127.0.0.1:9/v1/traces"), exporter=memory)

    async def run():
        path = TwoTries(Fleet(), ROUTERS["least-loaded"](), 16, Metrics("disaggregated"))
        stream = tracer.start("tandem.stream")
        prep = SimpleNamespace(request=SimpleNamespace(request_id="r"), params=SimpleNamespace(lora="", priority=0))
        tokens = [t.token async for t in path.run(prep, time.monotonic() + 30, stream)]
        stream.end()
        return tokens

    assert asyncio.run(run()) == [1, 2, 3]
    spans = [from_sdk(s) for s in memory.get_finished_spans()]
    stream = one(spans, "tandem.stream")
    first, resumed = sorted((s for s in spans if s.name == "tandem.attempt"), key=lambda s: s.start_ns)
    assert first.parent_id == resumed.parent_id == stream.span_id
    assert first.error and first.attributes["tandem.status"] == "UNAVAILABLE"
    assert first.attributes["tandem.resumed"] is False and first.attributes["tandem.decode_worker"] == "decode-0"
    assert not resumed.error and resumed.attributes["tandem.resumed"] is True
    assert resumed.attributes["tandem.resumed_after_tokens"] == 2 and resumed.attributes["tandem.retry"] == 1
    assert resumed.attributes["tandem.decode_worker"] == "decode-1"
    assert resumed.attributes["tandem.finish_reason"] == "length"
    tracer.close()


def test_a_bad_tracing_setting_stops_serve_with_one_line(built_engines):
    from ops.triton_process import free_port
    from tests.serve.test_startup_errors import one_error_line, run

    ports = ("--http-port", str(free_port()), "--grpc-port", str(free_port()))
    code, err = run("serve", "--model", str(built_engines), *ports, "--otlp-endpoint", "collector:4318")
    line = one_error_line(err)
    assert code != 0 and "'collector:4318' must be an http:// or https:// URL" in line
    code, err = run("serve", "--model", str(built_engines), *ports,
                    env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    line = one_error_line(err)
    assert code != 0 and "'http/json' is not supported; allowed: http/protobuf, grpc" in line


def test_colocated_trace_over_otlp_grpc_has_the_generate_workers_decode_span(built_engines, tmp_path):
    """A co-located worker prefills and decodes: its one span (local_prefill) hangs under the attempt.
    Everything goes out over OTLP/gRPC here (OTEL_EXPORTER_OTLP_PROTOCOL=grpc, a collector's port 4317
    protocol), the orchestrator's spans and the worker's alike."""
    traceparent, trace_id, _ = client_traceparent()
    with OtlpGrpcReceiver() as receiver:
        s = start_serve(built_engines, tmp_path, "--mode", "colocated", "--otlp-endpoint", receiver.url,
                        env={**FAST_EXPORT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
        try:
            answer = complete(s.http, "The capital of France is", 4, traceparent)
            spans = receiver.wait_for(lambda got: {"tandem.decode", "tandem.attempt"} <= {
                x.name for x in got if x.trace_id == trace_id})
        finally:
            stop_serve(s)
    mine = [x for x in spans if x.trace_id == trace_id]
    attempt, decode = one(mine, "tandem.attempt", "tandem"), one(mine, "tandem.decode", "tandem-generate")
    assert decode.parent_id == attempt.span_id and "tandem.prefill_worker" not in attempt.attributes
    assert decode.attributes["tandem.local_prefill"] is True
    assert decode.attributes["tandem.output_tokens"] == answer["usage"]["completion_tokens"] == 4
    assert not [x for x in mine if x.name in ("tandem.prefill", "tandem.kv_transfer", "tandem.decode_reservation")]
    assert {x.service for x in mine} == {"tandem", "tandem-generate"}
