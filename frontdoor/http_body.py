"""Reading a request body safely: by the time its connection's gate gives the request to arrive (a 408
after), and as JSON: bad JSON, deep nesting and lone surrogates are a 400 that says so, never a 500 (a
RecursionError or a UnicodeEncodeError deep inside)."""

from __future__ import annotations

import asyncio
import json

from frontdoor.http_gate import gate_of
from tandem.status import InvalidArgument, RequestTimeout

MAX_DEPTH = 64


def parse_json(raw: bytes, what: str = "request body"):
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidArgument(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)") from None
    _check(data, 0, what)
    return data


def _check(value, depth: int, what: str) -> None:
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"{what} holds a string that is not valid Unicode (a lone surrogate "
                                  f"escape such as \\ud800)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check(k, depth + 1, what)
            _check(v, depth + 1, what)
    elif isinstance(value, list):
        for v in value:
            _check(v, depth + 1, what)


async def read_body(request) -> bytes:
    """The whole body, read by the gate's `receive_by` (RequestTimeout when it does not arrive by then)."""
    gate = gate_of(request)
    if gate is None:
        return await request.read()
    try:
        async with asyncio.timeout_at(gate.receive_by):
            return await request.read()
    except TimeoutError:
        raise RequestTimeout(f"the request did not arrive whole within {gate.receive_s:g} s of the connection's "
                             f"start or its previous answer (the deployment's limits.receive_timeout_s)") from None


async def read_object(request, what: str = "request body") -> dict:
    data = parse_json(await read_body(request), what)
    if not isinstance(data, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    return data


TIMEOUT_HEADER = "Tandem-Timeout"  # seconds: this request's own deadline (the deployment's when absent)


def request_timeout(request) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400:
        raise InvalidArgument(f"header {TIMEOUT_HEADER} must be a number of seconds in (0, 86400], got {raw!r}")
    return value
