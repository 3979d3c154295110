"""The KServe v2 HTTP protocol for the served model (what `tritonclient.http` speaks): health,
metadata, config, and non-streamed inference with JSON tensors or the binary tensor data extension.
Inference is the KServe codec (frontdoor/kserve_codec.py, shared with gRPC) over the front-door core.
"""

from __future__ import annotations

import json

from aiohttp import web
from google.protobuf import json_format

from frontdoor.core import FrontDoor
from frontdoor.grpc_door import EXTENSIONS
from frontdoor.http_body import parse_json, read_body, request_timeout
from frontdoor.kserve_codec import (decode_call, http_inputs, output_tensors, refuse_model_control, repository_index,
                                    to_raw)
from tandem import __version__
from tandem.request_context import current_id
from tandem.status import InvalidArgument, NotFound


def add_kserve_routes(r, door: FrontDoor) -> None:
    api = KServeRoutes(door)
    r.add_get("/v2/health/live", api.live)
    r.add_get("/v2/health/ready", api.ready)
    r.add_get("/v2", api.server_metadata)
    r.add_get("/v2/models/stats", api.statistics)  # every model's (the one); before /v2/models/{model}
    r.add_get("/v2/models/{model}", api.model_metadata)
    r.add_get("/v2/models/{model}/versions/{version}", api.model_metadata)
    r.add_get("/v2/models/{model}/ready", api.model_ready)
    r.add_get("/v2/models/{model}/config", api.model_config)
    r.add_post("/v2/models/{model}/infer", api.infer)
    r.add_post("/v2/models/{model}/versions/{version}/infer", api.infer)
    r.add_post("/v2/repository/index", api.repository_index)
    r.add_post("/v2/repository/models/{model}/{action:load|unload}", api.model_control)


def check_model(served, request) -> None:
    """NotFound unless the route's {model}[/versions/{version}] names the served model."""
    name, version = request.match_info["model"], request.match_info.get("version", "")
    if not served.known_triton(name, version):
        raise NotFound(f"unknown model '{name}'; this server has '{served.triton_name}'")


class KServeRoutes:
    def __init__(self, door: FrontDoor):
        self.door, self.served = door, door.served
        self.service = door.service

    def _check_model(self, request) -> None:
        check_model(self.served, request)

    async def live(self, request):
        return web.Response(status=200)

    async def ready(self, request):
        return web.Response(status=200 if self.service.ready() else 503)

    async def server_metadata(self, request):
        return web.json_response({"name": "tandem", "version": __version__, "extensions": list(EXTENSIONS)})

    async def statistics(self, request):
        """Triton's statistics of every model: the served one's (its own route: http_generate.py)."""
        return web.json_response(self.served.stats.to_json(self.served.triton_name))

    async def model_metadata(self, request):
        self._check_model(request)
        return web.json_response(self.served.metadata())

    async def model_ready(self, request):
        self._check_model(request)
        return web.Response(status=200 if self.service.ready() else 400)

    async def model_config(self, request):
        self._check_model(request)
        return web.json_response(json_format.MessageToDict(self.served.config, preserving_proto_field_name=True))

    async def repository_index(self, request):
        """Triton's repository index; the body may be empty or {"ready": bool}."""
        body = parse_json(await read_body(request) or b"{}")
        ready = body.get("ready", False) if isinstance(body, dict) else None
        if not isinstance(ready, bool):
            raise InvalidArgument("the repository index request is an object with an optional boolean 'ready'")
        return web.json_response(repository_index(self.served, ready))

    async def model_control(self, request):
        refuse_model_control(request.match_info["action"], request.match_info["model"])

    async def infer(self, request):
        """A codec over the front-door core: the KServe codec decodes, the core collects, the codec
        produces every output the model advertises (or those named)."""
        self._check_model(request)
        self.service.refuse_if_closed()  # before the body is read: a refusal costs almost nothing
        header, binary = await self._infer_body(request)
        wanted = header.get("outputs") or []
        if not isinstance(wanted, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                   for o in wanted):
            raise InvalidArgument("'outputs' must be a list of objects with a 'name'")
        call = decode_call(http_inputs(header, binary), str(header.get("id") or current_id() or f"http-{id(request)}"),
                           [o["name"] for o in wanted], request_timeout(request), unary=True,
                           adapters=self.served.adapters, levels=self.served.levels,
                           parameters=header.get("parameters"))
        answers = await self.door.collect_all(call.requests)
        tensors = output_tensors([a.text for a in answers], [list(a.logprobs) for a in answers],
                                 [a.prompt_tokens for a in answers], [a.tokens for a in answers], call.wanted)
        return self._infer_response(header, call.request_id, tensors)

    async def _infer_body(self, request) -> tuple[dict, bytes]:
        raw = await read_body(request)
        n = request.headers.get("Inference-Header-Content-Length")
        try:
            split = int(n) if n is not None else len(raw)
        except ValueError:
            raise InvalidArgument(f"Inference-Header-Content-Length {n!r} is not an integer") from None
        if not 0 <= split <= len(raw):
            raise InvalidArgument(f"Inference-Header-Content-Length {split} is outside the body ({len(raw)} bytes)")
        header = parse_json(raw[:split], "inference request header")
        if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
            raise InvalidArgument("inference request must be a JSON object with an 'inputs' list")
        return header, raw[split:]

    def _infer_response(self, header: dict, rid: str, tensors) -> web.Response:
        """JSON data, or binary tensor data where asked for (per output, or for all by default)."""
        wanted = {o["name"]: o for o in header.get("outputs") or []}
        binary_default = bool((header.get("parameters") or {}).get("binary_data_output"))
        meta, blobs = [], []
        for spec, arr in tensors:
            entry = {"name": spec.name, "datatype": spec.datatype, "shape": list(arr.shape)}
            if (wanted.get(spec.name, {}).get("parameters") or {}).get("binary_data", binary_default):
                blob = to_raw(arr)
                entry["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                flat = arr.reshape(-1).tolist()
                entry["data"] = [x.decode() if isinstance(x, bytes) else x for x in flat]
            meta.append(entry)
        head = json.dumps({"model_name": self.served.triton_name, "model_version": "1", "id": rid,
                           "outputs": meta}).encode()
        if not blobs:
            return web.Response(body=head, content_type="application/json")
        return web.Response(body=head + b"".join(blobs), content_type="application/octet-stream",
                            headers={"Inference-Header-Content-Length": str(len(head))})
