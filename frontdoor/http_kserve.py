"""The KServe v2 HTTP protocol for the served model (what `tritonclient.http` speaks): health,
metadata, config, and non-streamed inference with JSON tensors or the binary tensor data extension.

JSON tensor data is checked against its datatype's range: 3_000_000_000 for an INT32 is refused, not
wrapped around.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import numpy as np
from aiohttp import web
from google.protobuf import json_format

from frontdoor.model_contract import OUTPUTS, parse_requests
from frontdoor.grpc_door import EXTENSIONS
from frontdoor.http_body import parse_json, request_timeout
from frontdoor.served_model import ServedModel
from frontdoor.tensors import DTYPES, TensorError, from_raw, to_raw
from tandem import __version__
from tandem.status import InvalidArgument, NotFound, TandemError


def add_kserve_routes(r, served: ServedModel) -> None:
    api = KServeRoutes(served)
    r.add_get("/v2/health/live", lambda req: web.Response(status=200))
    r.add_get("/v2/health/ready", lambda req: web.Response(status=200 if served.service.ready() else 503))
    r.add_get("/v2", api.server_metadata)
    r.add_get("/v2/models/{model}", api.model_metadata)
    r.add_get("/v2/models/{model}/versions/{version}", api.model_metadata)
    r.add_get("/v2/models/{model}/ready", api.model_ready)
    r.add_get("/v2/models/{model}/config", api.model_config)
    r.add_post("/v2/models/{model}/infer", api.infer)
    r.add_post("/v2/models/{model}/versions/{version}/infer", api.infer)


class KServeRoutes:
    def __init__(self, served: ServedModel):
        self.served = served
        self.service = served.service

    def _check_model(self, request) -> None:
        name, version = request.match_info["model"], request.match_info.get("version", "")
        if not self.served.known_triton(name, version):
            raise NotFound(f"unknown model '{name}'; this server has '{self.served.triton_name}'")

    async def server_metadata(self, request):
        return web.json_response({"name": "tandem", "version": __version__, "extensions": list(EXTENSIONS)})

    async def model_metadata(self, request):
        self._check_model(request)
        return web.json_response(self.served.metadata())

    async def model_ready(self, request):
        self._check_model(request)
        return web.Response(status=200 if self.service.ready() else 400)

    async def model_config(self, request):
        self._check_model(request)
        return web.json_response(json_format.MessageToDict(self.served.config, preserving_proto_field_name=True))

    async def infer(self, request):
        self._check_model(request)
        self.service.refuse_if_closed()  # before the body is read: a refusal costs almost nothing
        start = time.perf_counter()
        header, binary = await self._infer_body(request)
        inputs = _decode_inputs(header, binary)
        rid = str(header.get("id") or f"http-{id(request)}")
        reqs, stream = parse_requests(inputs, rid)
        timeout = request_timeout(request)
        reqs = [dataclasses.replace(r, timeout_s=timeout) for r in reqs]
        if stream:
            raise InvalidArgument("streaming needs gRPC ModelStreamInfer or /v1/*/completions with stream=true")
        try:
            preps = [await self.service.prepare(r) for r in reqs]
            results = await asyncio.gather(*[self.served.collect(p) for p in preps])
        except TandemError:
            self.served.stats.record(False, start)
            raise
        self.served.stats.record(True, start)
        texts = [(p.request.prompt if not p.request.exclude_input else "") + t for p, (t, *_) in zip(preps, results)]
        b = len(texts)
        outputs = {"text_output": np.array([t.encode() for t in texts], dtype=np.object_).reshape(b, 1),
                   "num_input_tokens": np.array([len(p.prompt_ids) for p in preps], dtype=np.int32).reshape(b, 1),
                   "num_output_tokens": np.array([r[2] for r in results], dtype=np.int32).reshape(b, 1)}
        return self._infer_response(header, rid, outputs)

    async def _infer_body(self, request) -> tuple[dict, bytes]:
        raw = await request.read()
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
        head = json.dumps({"model_name": self.served.triton_name, "model_version": "1", "id": rid,
                           "outputs": meta}).encode()
        if not blobs:
            return web.Response(body=head, content_type="application/json")
        return web.Response(body=head + b"".join(blobs), content_type="application/octet-stream",
                            headers={"Inference-Header-Content-Length": str(len(head))})


def _decode_inputs(header: dict, binary: bytes) -> dict:
    inputs, offset = {}, 0
    for t in header["inputs"]:
        if not isinstance(t, dict) or not {"name", "datatype", "shape"} <= set(t):
            raise InvalidArgument("each input needs name, datatype and shape")
        name, dt, shape = t["name"], t["datatype"], t["shape"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise InvalidArgument(f"input {name!r}: shape must be a list of integers")
        size = (t.get("parameters") or {}).get("binary_data_size")
        try:
            if size is not None:
                if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                    raise InvalidArgument(f"input {name!r}: binary_data_size {size!r} does not fit the body")
                arr = from_raw(name, dt, shape, binary[offset:offset + size])
                offset += size
            else:
                arr = json_tensor(name, dt, shape, t.get("data"))
        except (TensorError, ValueError) as e:
            raise InvalidArgument(f"input {name!r}: {e}") from None
        inputs[name] = (dt, arr)
    return inputs


def json_tensor(name: str, dt: str, shape: list[int], data) -> np.ndarray:
    if dt not in DTYPES or data is None:
        raise InvalidArgument(f"input {name!r}: needs 'data' (or binary data) of a known datatype")
    flat = np.array(data, dtype=object).reshape(-1)
    if dt == "BYTES":
        return np.array([x.encode() if isinstance(x, str) else x for x in flat], dtype=np.object_).reshape(shape)
    kind = np.dtype(DTYPES[dt])
    if kind.kind in "iu":
        info = np.iinfo(kind)
        bad = [x for x in flat if isinstance(x, bool) or not isinstance(x, int) or not info.min <= x <= info.max]
        if bad:
            raise InvalidArgument(f"input {name!r}: {bad[0]!r} is not a {dt} (range [{info.min}, {info.max}])")
    elif kind.kind == "b":
        if any(not isinstance(x, bool) for x in flat):
            raise InvalidArgument(f"input {name!r}: BOOL data must be true or false")
    elif any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in flat):
        raise InvalidArgument(f"input {name!r}: {dt} data must be numbers")
    return flat.astype(kind).reshape(shape)
