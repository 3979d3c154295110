"""The KServe v2 codec, one for both transports: Triton gRPC (grpc_door.py) and KServe v2 HTTP
(http_kserve.py) accept the same inputs, produce the same outputs and refuse the same things.

    tensors in (gRPC protobuf, or HTTP JSON / binary tensor data) ──▶ decode_call ──▶ InferCall
    Answer / Delta (frontdoor/core.py) ──▶ output_tensors ──▶ every output the model advertises
                                                              (or those the client named)

Refused on both, with the reason: a requested output the model lacks, an input the model lacks or of
the wrong datatype, data that is not a list where a tensor is expected (`"data": "Hi"`), data whose
element count does not match its shape, a number out of its datatype's range (3_000_000_000 for an
INT32 is refused, not wrapped around), and `stream=true` on a unary call. Both read Triton's
schedule-policy parameters, `priority` and `timeout` (frontdoor/schedule_policy.py).

Raw tensor bytes (gRPC raw contents, HTTP binary tensor data) are little-endian, row-major; a BYTES
tensor is each element as a 4-byte little-endian length followed by its bytes (from_raw, to_raw).
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import numpy as np

from frontdoor.model_contract import OUTPUTS, TensorSpec, parse_requests
from frontdoor.schedule_policy import PriorityLevels, schedule_of
from control.requests import GenerationRequest
from tandem.status import InvalidArgument, MethodNotAllowed, NotFound

_OUTPUT_NAMES = tuple(t.name for t in OUTPUTS)
Inputs = dict[str, tuple[str, np.ndarray]]  # name -> (datatype, array shaped [batch, ...])
DTYPES = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
          "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_}


class TensorError(ValueError):
    """A tensor could not be decoded; the message names it and says what was wrong."""


def decode_bytes(buf: bytes, count: int, name: str) -> list[bytes]:
    out, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(buf):
            raise TensorError(f"input {name!r}: BYTES data ends early (expected {count} elements)")
        (n,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if pos + n > len(buf):
            raise TensorError(f"input {name!r}: BYTES element of {n} bytes runs past the data")
        out.append(bytes(buf[pos:pos + n]))
        pos += n
    if pos != len(buf):
        raise TensorError(f"input {name!r}: {len(buf) - pos} bytes left over after {count} BYTES elements")
    return out


def encode_bytes(items) -> bytes:
    parts = []
    for item in items:
        b = item if isinstance(item, bytes) else str(item).encode()
        parts.append(struct.pack("<I", len(b)) + b)
    return b"".join(parts)


def from_raw(name: str, datatype: str, shape: list[int], raw: bytes) -> np.ndarray:
    if datatype not in DTYPES:
        raise TensorError(f"input {name!r}: unknown datatype {datatype!r}")
    if any(d < 0 for d in shape):
        raise TensorError(f"input {name!r}: shape {shape} has a negative dimension")
    count = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        return np.array(decode_bytes(raw, count, name), dtype=np.object_).reshape(shape)
    dt = np.dtype(DTYPES[datatype]).newbyteorder("<")
    if len(raw) != count * dt.itemsize:
        raise TensorError(f"input {name!r}: {len(raw)} bytes do not hold {count} {datatype} values")
    return np.frombuffer(raw, dtype=dt).astype(DTYPES[datatype]).reshape(shape)


def to_raw(arr: np.ndarray) -> bytes:
    if arr.dtype == np.object_:
        return encode_bytes(arr.reshape(-1).tolist())
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


@dataclass(frozen=True)
class InferCall:
    """One KServe infer request, decoded: a GenerationRequest per batch row."""

    request_id: str
    requests: list[GenerationRequest]
    stream: bool
    wanted: frozenset[str]  # outputs the client named (empty: all of them)


def decode_call(inputs: Inputs, request_id: str, wanted: list[str], timeout_s: float | None,
                unary: bool, adapters: tuple[str, ...] = (), parameters: dict | None = None,
                levels: PriorityLevels = PriorityLevels()) -> InferCall:
    """The typed call; `unary`: the transport answers once (ModelInfer, HTTP infer): stream=true is refused.
    `adapters`: the LoRA adapters a `lora_name` may name (another is NOT_FOUND); `parameters`: the
    request's (name -> plain value): its priority level, read on the served model's `levels`, and timeout
    (frontdoor/schedule_policy.py)."""
    schedule = schedule_of(parameters or {}, levels)
    unknown = sorted(set(wanted) - set(_OUTPUT_NAMES))
    if unknown:
        raise InvalidArgument(f"unknown outputs {unknown}; this model has {', '.join(_OUTPUT_NAMES)}")
    reqs, stream = parse_requests(inputs, request_id)
    for r in reqs:
        if r.model is not None and r.model not in adapters:
            raise NotFound(f"unknown LoRA adapter {r.model!r:.80} in lora_name; this server serves "
                           f"{list(adapters) or 'none'} (tandem serve --lora-modules)")
    if stream and unary:
        raise InvalidArgument("stream=true needs a streaming call: gRPC ModelStreamInfer, or /v1/completions "
                              "and /v1/chat/completions with \"stream\": true")
    timeouts = [t for t in (timeout_s, schedule.timeout_s) if t is not None]
    reqs = [dataclasses.replace(r, timeout_s=min(timeouts) if timeouts else r.timeout_s, priority=schedule.priority)
            for r in reqs]
    return InferCall(request_id, reqs, stream, frozenset(wanted))


def output_tensors(texts: list[str], logprobs: list[list[float]], n_in: list[int], n_out: list[int],
                   wanted: frozenset[str]) -> list[tuple[TensorSpec, np.ndarray]]:
    """The model's outputs for a batch (each list has one entry per row), in the model's order;
    `wanted`: the outputs the client named (empty: all of them)."""
    b = len(texts)
    width = max((len(lp) for lp in logprobs), default=0)
    lp = np.array([row + [0.0] * (width - len(row)) for row in logprobs], dtype=np.float32).reshape(b, width)
    arrays = {
        "text_output": lambda: np.array([t.encode() for t in texts], dtype=np.object_).reshape(b, 1),
        "output_log_probs": lambda: lp,  # [b, tokens]
        "cum_log_probs": lambda: lp.sum(axis=1, keepdims=True, dtype=np.float32),  # [b, 1]
        "num_input_tokens": lambda: np.array(n_in, dtype=np.int32).reshape(b, 1),
        "num_output_tokens": lambda: np.array(n_out, dtype=np.int32).reshape(b, 1),
    }
    return [(spec, arrays[spec.name]()) for spec in OUTPUTS if not wanted or spec.name in wanted]


# -- reading input tensors ------------------------------------------------------------------------------

def grpc_inputs(request) -> Inputs:
    """The input tensors of a gRPC ModelInferRequest (raw bytes, or the typed `contents` fields)."""
    if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
        raise InvalidArgument("raw_input_contents must have one entry per input")
    inputs: Inputs = {}
    for i, t in enumerate(request.inputs):
        raw = request.raw_input_contents[i] if request.raw_input_contents else _contents(t)
        try:
            _add(inputs, t.name, t.datatype, from_raw(t.name, t.datatype, list(t.shape), raw))
        except TensorError as e:
            raise InvalidArgument(str(e)) from None
    return inputs


def http_inputs(header: dict, binary: bytes) -> Inputs:
    """The input tensors of a KServe v2 HTTP request: JSON `data`, or binary tensor data after the header."""
    inputs: Inputs = {}
    offset = 0
    for t in header["inputs"]:
        if not isinstance(t, dict) or not {"name", "datatype", "shape"} <= set(t):
            raise InvalidArgument("each input needs name, datatype and shape")
        name, dt, shape = t["name"], t["datatype"], t["shape"]
        if not isinstance(name, str) or not isinstance(dt, str):
            raise InvalidArgument("an input's name and datatype must be strings")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise InvalidArgument(f"input {name!r}: shape must be a list of integers")
        size = (t.get("parameters") or {}).get("binary_data_size")
        try:
            if size is not None:
                if isinstance(size, bool) or not isinstance(size, int) or size < 0 or offset + size > len(binary):
                    raise InvalidArgument(f"input {name!r}: binary_data_size {size!r} does not fit the body")
                arr = from_raw(name, dt, shape, binary[offset:offset + size])
                offset += size
            else:
                arr = json_tensor(name, dt, shape, t.get("data"))
        except TensorError as e:
            raise InvalidArgument(str(e)) from None
        _add(inputs, name, dt, arr)
    return inputs


def _add(inputs: Inputs, name: str, datatype: str, arr: np.ndarray) -> None:
    if name in inputs:
        raise InvalidArgument(f"input {name!r} given twice")
    inputs[name] = (datatype, arr)


def _contents(t) -> bytes:
    """Inputs sent in the typed `contents` fields instead of raw bytes (clients may do either)."""
    c = t.contents
    if t.datatype == "BYTES":
        return encode_bytes(list(c.bytes_contents))
    field = {"INT32": (c.int_contents, np.int32), "UINT64": (c.uint64_contents, np.uint64),
             "FP32": (c.fp32_contents, np.float32), "BOOL": (c.bool_contents, np.bool_),
             "INT64": (c.int64_contents, np.int64)}.get(t.datatype)
    if field is None:
        raise InvalidArgument(f"input {t.name!r}: datatype {t.datatype} is not used by this model")
    return np.array(list(field[0]), dtype=field[1]).tobytes()


def _flatten(data, name: str) -> list:
    """JSON tensor data, row-major: a flat or nested list (a lone value is not a tensor)."""
    if not isinstance(data, list):
        raise InvalidArgument(f"input {name!r}: 'data' must be a list (row-major, flat or nested), "
                              f"got {type(data).__name__}")
    out = []
    for x in data:
        out.extend(_flatten(x, name) if isinstance(x, list) else [x])
    return out


def json_tensor(name: str, dt: str, shape: list[int], data) -> np.ndarray:
    if dt not in DTYPES or data is None:
        raise InvalidArgument(f"input {name!r}: needs 'data' (or binary data) of a known datatype")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"input {name!r}: shape {shape} has a negative dimension")
    flat = _flatten(data, name)
    count = int(np.prod(shape)) if shape else 1
    if len(flat) != count:
        raise InvalidArgument(f"input {name!r}: {len(flat)} values do not fill shape {shape} ({count} values)")
    if dt == "BYTES":
        if not all(isinstance(x, str) for x in flat):
            raise InvalidArgument(f"input {name!r}: BYTES data must be strings")
        return np.array([x.encode() for x in flat], dtype=np.object_).reshape(shape)
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
    return np.array(flat, dtype=object).astype(kind).reshape(shape)


def repository_index(served, ready_only: bool) -> list[dict]:
    """Triton's model repository index: the one served model (`ready_only`: only if it is ready), as
    {"name", "version", "state", "reason"} (the gRPC ModelIndex's fields, the HTTP reply's objects)."""
    ready = served.service.ready()
    if ready_only and not ready:
        return []
    return [{"name": served.triton_name, "version": "1", "state": "READY" if ready else "UNAVAILABLE",
             "reason": "" if ready else "not ready: draining, or no worker of a role it needs is ready"}]


def refuse_model_control(action: str, name: str) -> None:
    """Triton's model control (load, unload): this server serves the one model it started with."""
    raise MethodNotAllowed(f"cannot {action} model '{name}': this server serves the one model it started with "
                           f"(as Triton's model control mode none); start another tandem serve for another model")
