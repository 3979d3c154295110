"""Front door 2: HTTP. OpenAI-compatible endpoints, health, Prometheus metrics, and the KServe v2
HTTP protocol for the same `ensemble` model (so `tritonclient.http` works too).

    GET  /health   /metrics   /v1/models
    POST /v1/completions   /v1/chat/completions      (SSE streaming with "stream": true)
    GET  /v2/health/live   /v2/health/ready   /v2   /v2/models/{m}   /v2/models/{m}/ready   /v2/models/{m}/config
    POST /v2/models/{m}/infer                        (JSON tensors, or the binary tensor data extension)

Bad input gets HTTP 400 with an OpenAI-style error body naming the problem; a request no worker
could serve gets 503.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
from aiohttp import web
from google.protobuf import json_format

from orchestrator import openai_api as oa
from orchestrator.ensemble import INPUTS, OUTPUTS, parse_requests
from orchestrator.grpc_frontend import EXTENSIONS, TritonProtocolServicer
from orchestrator.requests import BadRequest, Unavailable
from orchestrator.tensors import DTYPES, TensorError, from_raw, to_raw
from tandem import __version__


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return web.json_response(oa.error_body(message, param, kind), status=status)


class HttpFrontend:
    def __init__(self, triton: TritonProtocolServicer):
        self.triton = triton
        self.service = triton.service
        self.model = triton.model
        self.app = web.Application(client_max_size=64 << 20, middlewares=[self._errors])
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_get("/v2/health/live", lambda req: web.Response(status=200))
        r.add_get("/v2/health/ready", lambda req: web.Response(status=200 if self.service.ready() else 503))
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/models/{model}", self.model_metadata)
        r.add_get("/v2/models/{model}/versions/{version}", self.model_metadata)
        r.add_get("/v2/models/{model}/ready", self.model_ready)
        r.add_get("/v2/models/{model}/config", self.model_config)
        r.add_post("/v2/models/{model}/infer", self.infer)
        r.add_post("/v2/models/{model}/versions/{version}/infer", self.infer)

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            return _error(400, str(e), e.param)
        except Unavailable as e:
            return _error(503, str(e), kind="service_unavailable")

    async def _json(self, request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    async def health(self, request):
        ok = self.service.ready()
        return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

    async def metrics(self, request):
        return web.Response(body=self.service.metrics.render(), content_type="text/plain", charset="utf-8")

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "created": 0, "owned_by": "tandem"}]})

    # -- OpenAI -------------------------------------------------------------------------------------

    async def completions(self, request):
        body = await self._json(request)
        rid = oa.new_id("cmpl")
        req, stream = oa.completion_request(body, self.model, rid)
        return await self._openai(request, req, stream, rid, oa.completion_body, body)

    async def chat(self, request):
        body = await self._json(request)
        rid = oa.new_id("chatcmpl")
        req, stream = oa.chat_request(body, self.model, rid)
        return await self._openai(request, req, stream, rid, oa.chat_body, body)

    async def _openai(self, request, req, stream: bool, rid: str, shape, body: dict):
        prep = self.service.prepare(req)
        n_in = len(prep.prompt_ids)
        if not stream:
            text, reason, n = [], None, 0
            async for d in self.service.stream(prep):
                text.append(d.text)
                n += d.token is not None
                reason = d.finish_reason or reason
            return web.json_response(shape(rid, self.model, "".join(text), reason, oa.usage(n_in, n), chunk=False))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        n, first = 0, True
        try:
            async for d in self.service.stream(prep):
                n += d.token is not None
                if not d.text and not d.finish_reason:
                    continue
                extra = {"first": first} if shape is oa.chat_body else {}
                await _sse(resp, shape(rid, self.model, d.text, d.finish_reason, None, chunk=True, **extra))
                first = False
            if include_usage:
                chunk = shape(rid, self.model, "", None, oa.usage(n_in, n), chunk=True)
                chunk["choices"] = []
                await _sse(resp, chunk)
        except (BadRequest, Unavailable) as e:
            await _sse(resp, oa.error_body(str(e), kind="service_unavailable"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- KServe v2 HTTP -----------------------------------------------------------------------------

    def _check_model(self, request) -> None:
        name, version = request.match_info["model"], request.match_info.get("version", "")
        if not self.triton._known(name, version):
            raise web.HTTPNotFound(text=json.dumps({"error": f"unknown model '{name}'; this server has "
                                                             f"'{self.model}'"}), content_type="application/json")

    async def server_metadata(self, request):
        return web.json_response({"name": "tandem", "version": __version__, "extensions": list(EXTENSIONS)})

    async def model_metadata(self, request):
        self._check_model(request)
        meta = lambda ts: [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.dims]} for t in ts]  # noqa: E731
        return web.json_response({"name": self.model, "versions": ["1"], "platform": "python",
                                  "inputs": meta(INPUTS), "outputs": meta(OUTPUTS)})

    async def model_ready(self, request):
        self._check_model(request)
        return web.Response(status=200 if self.service.ready() else 400)

    async def model_config(self, request):
        self._check_model(request)
        return web.json_response(json_format.MessageToDict(self.triton.config, preserving_proto_field_name=True))

    async def infer(self, request):
        self._check_model(request)
        start = time.perf_counter()
        header, binary = await self._infer_body(request)
        inputs = self._decode_inputs(header, binary)
        rid = str(header.get("id") or f"http-{id(request)}")
        reqs, stream = parse_requests(inputs, rid)
        if stream:
            raise BadRequest("streaming needs gRPC ModelStreamInfer or /v1/*/completions with stream=true")
        preps = [self.service.prepare(r) for r in reqs]
        try:
            results = await asyncio.gather(*[self.triton._collect(p) for p in preps])
        except (BadRequest, Unavailable):
            self.triton.stats.record(False, start)
            raise
        self.triton.stats.record(True, start)
        texts = [(p.request.prompt if not p.request.exclude_input else "") + t for p, (t, _, _) in zip(preps, results)]
        b = len(texts)
        outputs = {"text_output": np.array([t.encode() for t in texts], dtype=np.object_).reshape(b, 1),
                   "num_input_tokens": np.array([len(p.prompt_ids) for p in preps], dtype=np.int32).reshape(b, 1),
                   "num_output_tokens": np.array([n for _, _, n in results], dtype=np.int32).reshape(b, 1)}
        return self._infer_response(header, rid, outputs)

    async def _infer_body(self, request) -> tuple[dict, bytes]:
        raw = await request.read()
        n = request.headers.get("Inference-Header-Content-Length")
        try:
            split = int(n) if n is not None else len(raw)
            header = json.loads(raw[:split])
        except (ValueError, json.JSONDecodeError) as e:
            raise BadRequest(f"inference request header is not valid JSON: {e}") from None
        if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
            raise BadRequest("inference request must be a JSON object with an 'inputs' list")
        return header, raw[split:]

    def _decode_inputs(self, header: dict, binary: bytes) -> dict:
        inputs, offset = {}, 0
        for t in header["inputs"]:
            if not isinstance(t, dict) or not {"name", "datatype", "shape"} <= set(t):
                raise BadRequest("each input needs name, datatype and shape")
            name, dt, shape = t["name"], t["datatype"], t["shape"]
            size = (t.get("parameters") or {}).get("binary_data_size")
            try:
                if size is not None:
                    arr = from_raw(name, dt, shape, binary[offset:offset + size])
                    offset += size
                else:
                    data = t.get("data")
                    if dt not in DTYPES or data is None:
                        raise BadRequest(f"input {name!r}: needs 'data' (or binary data) of a known datatype")
                    flat = np.array(data, dtype=object).reshape(-1) if dt == "BYTES" else np.array(data).reshape(-1)
                    arr = (np.array([x.encode() if isinstance(x, str) else x for x in flat], dtype=np.object_)
                           if dt == "BYTES" else flat.astype(DTYPES[dt])).reshape(shape)
            except (TensorError, ValueError) as e:
                raise BadRequest(f"input {name!r}: {e}") from None
            inputs[name] = (dt, arr)
        return inputs

    def _infer_response(self, header: dict, rid: str, outputs: dict) -> web.Response:
        wanted = {o["name"]: o for o in header.get("outputs") or [] if isinstance(o, dict) and "name" in o}
        binary_default = bool((header.get("parameters") or {}).get("binary_data_output"))
        meta, blobs = [], []
        for name, arr in outputs.items():
            if wanted and name not in wanted:
                continue
            spec = next(t for t in OUTPUTS if t.name == name)
            entry = {"name": name, "datatype": spec.datatype, "shape": list(arr.shape)}
            if (wanted.get(name, {}).get("parameters") or {}).get("binary_data", binary_default):
                blob = to_raw(arr)
                entry["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                flat = arr.reshape(-1).tolist()
                entry["data"] = [x.decode() if isinstance(x, bytes) else x for x in flat]
            meta.append(entry)
        head = json.dumps({"model_name": self.model, "model_version": "1", "id": rid, "outputs": meta}).encode()
        if not blobs:
            return web.Response(body=head, content_type="application/json")
        return web.Response(body=head + b"".join(blobs), content_type="application/octet-stream",
                            headers={"Inference-Header-Content-Length": str(len(head))})


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


async def start_http(frontend: HttpFrontend, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(frontend.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner
