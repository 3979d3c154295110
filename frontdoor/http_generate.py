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
import json

from aiohttp import web

from frontdoor.http_body import read_object, request_timeout
from frontdoor.http_kserve import check_model
from frontdoor.core import FrontDoor
from frontdoor.kserve_codec import json_tensor
from frontdoor.model_contract import INPUTS, parse_requests
from frontdoor.protocol_status import http_headers, http_status
from tandem.status import Internal, InvalidArgument, TandemError, status_of

_SPECS = {t.name: t for t in INPUTS}
_GONE = (ConnectionResetError, ConnectionError)


def add_generate_routes(r, door: FrontDoor) -> None:
    api = GenerateRoutes(door)
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
    """A codec over the front-door core (frontdoor/core.py), which also keeps the model's statistics."""

    def __init__(self, door: FrontDoor):
        self.door, self.served = door, door.served
        self.service = door.service

    async def stats(self, request):
        check_model(self.served, request)
        return web.json_response(self.served.stats.to_json(self.served.triton_name))

    async def generate(self, request):
        try:
            req = await self._request(request, stream=False)
            a = await self.door.collect(req)
        except TandemError as e:
            return _error(e)
        out = self._head() | {"text_output": a.text, "num_input_tokens": a.prompt_tokens,
                              "num_output_tokens": a.tokens}
        if req.logprobs:
            out["output_log_probs"] = list(a.logprobs)
        return web.json_response(out)

    async def generate_stream(self, request):
        """One event per piece of new text; the response starts with the first delta, so a refusal before
        it is still an HTTP status."""
        try:
            req = await self._request(request, stream=True)
        except TandemError as e:
            return _error(e)
        resp, n = None, 0
        async with contextlib.aclosing(self.door.answer(req)) as deltas:
            try:
                async for d in deltas:
                    if resp is None:
                        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                           "Cache-Control": "no-cache"})
                        await resp.prepare(request)
                    n += d.token is not None
                    if d.text or d.finish_reason:
                        out = self._head() | {"text_output": d.text, "num_output_tokens": n}
                        if req.logprobs and d.logprob is not None:
                            out["output_log_probs"] = [d.logprob]
                        await _event(resp, out)
            except TandemError as e:
                if resp is None:
                    return _error(e)
                with contextlib.suppress(*_GONE):
                    await _event(resp, {"error": str(e), "status": status_of(e).value})
            except _GONE:
                return resp
        if resp is None:
            return _error(Internal("the answer ended before its first delta"))
        with contextlib.suppress(*_GONE):
            await resp.write_eof()
        return resp

    async def _request(self, request, stream: bool):
        check_model(self.served, request)
        self.service.refuse_if_closed()
        body = await read_object(request)
        reqs, _ = parse_requests(generate_inputs(body, stream), str(body.get("id") or f"gen-{id(request)}"))
        return dataclasses.replace(reqs[0], timeout_s=request_timeout(request))

    def _head(self) -> dict:
        return {"model_name": self.served.triton_name, "model_version": "1"}


async def _event(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


def _error(e: TandemError) -> web.Response:
    status = status_of(e)
    return web.json_response({"error": str(e)}, status=http_status(status), headers=http_headers(status))
