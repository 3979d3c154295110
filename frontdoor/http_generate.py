"""Triton's generate extension and model statistics on the HTTP door, for the served model's Triton name.

    POST /v2/models/{m}[/versions/1]/generate          one JSON answer
    POST /v2/models/{m}[/versions/1]/generate_stream   Server-Sent Events, one per piece of new text
    GET  /v2/models/{m}[/versions/1]/stats             Triton's statistics-extension JSON

A generate request is `{"text_input": "...", "parameters": {...}}`; as in Triton, any other top-level
field is an input too (TensorRT-LLM's curl examples put `max_tokens` there). Every name is an input of
the ensemble contract (frontdoor/model_contract.py), checked against its datatype, so /generate takes
exactly what KServe infer takes. A response carries `model_name`, `model_version` and the outputs by
name (`text_output`, `num_input_tokens`, `num_output_tokens`, and `output_log_probs` with
return_log_probs). Errors are Triton's `{"error": "..."}` with the status's HTTP code; a failure after a
stream began is a last SSE event of that shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from aiohttp import web

from frontdoor.http_body import read_object, request_timeout
from frontdoor.http_kserve import json_tensor
from frontdoor.model_contract import INPUTS, parse_requests
from frontdoor.protocol_status import http_headers, http_status
from frontdoor.served_model import ServedModel
from frontdoor.sse import first_delta, send_event
from tandem.status import InvalidArgument, NotFound, TandemError, status_of

_SPECS = {t.name: t for t in INPUTS}
_GONE = (ConnectionResetError, ConnectionError)


def add_generate_routes(r, served: ServedModel) -> None:
    api = GenerateRoutes(served)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        r.add_post(prefix + "/generate", api.generate)
        r.add_post(prefix + "/generate_stream", api.generate_stream)
        r.add_get(prefix + "/stats", api.stats)


def generate_inputs(body: dict, stream: bool) -> dict:
    """The request's fields (top level and `parameters`) as ensemble input tensors shaped [1, ...]."""
    params = body.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidArgument("'parameters' must be a JSON object of name: value")
    fields = {k: v for k, v in body.items() if k not in ("parameters", "id")} | params
    fields["stream"] = stream
    inputs = {}
    for name, value in fields.items():
        spec = _SPECS.get(name)
        if spec is None:
            raise InvalidArgument(f"unknown input {name!r}; this model takes {', '.join(_SPECS)}")
        data = value if spec.dims == (-1,) and isinstance(value, list) else [value]
        inputs[name] = (spec.datatype, json_tensor(name, spec.datatype, [1, len(data)], data))
    return inputs


class GenerateRoutes:
    def __init__(self, served: ServedModel):
        self.served = served
        self.service = served.service

    def _check_model(self, request) -> None:
        name, version = request.match_info["model"], request.match_info.get("version", "")
        if not self.served.known_triton(name, version):
            raise NotFound(f"unknown model '{name}'; this server has '{self.served.triton_name}'")

    async def stats(self, request):
        self._check_model(request)
        return web.json_response(self.served.stats.to_json(self.served.triton_name))

    async def generate(self, request):
        try:
            prep, start = await self._prepare(request, stream=False)
        except TandemError as e:
            return _error(e)
        try:
            text, logprobs, n, _ = await self.served.collect(prep)
        except TandemError as e:
            self.served.stats.record(False, start)
            return _error(e)
        self.served.stats.record(True, start)
        prompt = "" if prep.request.exclude_input else prep.request.prompt
        out = self._head() | {"text_output": prompt + text, "num_input_tokens": len(prep.prompt_ids),
                              "num_output_tokens": n}
        if prep.request.logprobs:
            out["output_log_probs"] = logprobs
        return web.json_response(out)

    async def generate_stream(self, request):
        try:
            prep, start = await self._prepare(request, stream=True)
        except TandemError as e:
            return _error(e)
        deltas = self.service.stream(prep)
        try:
            first = await first_delta(deltas)
        except TandemError as e:
            self.served.stats.record(False, start)
            return _error(e)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        ok = False
        async with contextlib.aclosing(deltas):
            try:
                d, n = first, 0
                while d is not None:
                    n += d.token is not None
                    if d.text or d.finish_reason:
                        out = self._head() | {"text_output": d.text, "num_output_tokens": n}
                        if prep.request.logprobs and d.logprob is not None:
                            out["output_log_probs"] = [d.logprob]
                        await send_event(resp, out)
                    d = await anext(deltas, None)
                ok = True
            except TandemError as e:
                with contextlib.suppress(*_GONE):
                    await send_event(resp, {"error": str(e), "status": status_of(e).value})
            except _GONE:
                return resp
            finally:
                self.served.stats.record(ok, start)
        with contextlib.suppress(*_GONE):
            await resp.write_eof()
        return resp

    async def _prepare(self, request, stream: bool):
        self._check_model(request)
        self.service.refuse_if_closed()
        start = time.perf_counter()
        body = await read_object(request)
        reqs, _ = parse_requests(generate_inputs(body, stream), str(body.get("id") or f"gen-{id(request)}"))
        req = dataclasses.replace(reqs[0], timeout_s=request_timeout(request))
        return await self.service.prepare(req), start

    def _head(self) -> dict:
        return {"model_name": self.served.triton_name, "model_version": "1"}


def _error(e: TandemError) -> web.Response:
    status = status_of(e)
    return web.json_response({"error": str(e)}, status=http_status(status), headers=http_headers(status))
