"""KServe v2 tensor encoding, shared by the gRPC and HTTP front doors.

Raw tensor bytes are little-endian, row-major; a BYTES tensor is each element as a 4-byte
little-endian length followed by its bytes.
"""

from __future__ import annotations

import struct

import numpy as np

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

