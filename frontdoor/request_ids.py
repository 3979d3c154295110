"""Request ids and the access log, on both front doors.

A request's id is the client's `X-Request-Id` (HTTP header, or gRPC metadata `x-request-id`) when it is
a valid one (tandem/request_context.py: 1-128 characters, no spaces), else a fresh one. It is:
- the current request while the request is served, so every log line about it names it (tandem/logs.py);
- returned: the `X-Request-Id` response header (every HTTP response, errors and streams included), or
  gRPC initial metadata `x-request-id`;
- with the client's W3C `traceparent` (header or metadata), the parent of the request's trace
  (frontdoor/core.py, tandem/tracing.py);
- part of the id the doors give the request (OpenAI `cmpl-<id>`, the KServe `id` when the client sent
  none), which is what the workers receive on every wire message about it.

When the request ends, one access line (ops/logs.log_access): method, route, status, duration and the
tokens it used. A refusal by the HTTP gate (frontdoor/http_gate.py) happens before aiohttp and so
before this: it carries no id and writes no access line; the 429 counters count it.
"""

from __future__ import annotations

import contextlib
import time

import grpc
from aiohttp import web

from frontdoor.grpc_calls import around_calls
from tandem.logs import log_access
from tandem.request_context import begin, end, is_valid_id, new_request_id

HEADER = "X-Request-Id"
METADATA = "x-request-id"
TRACEPARENT = "traceparent"  # W3C trace context: the HTTP header and the gRPC metadata key (tandem/tracing.py)
# aiohttp 3.14 types a request's storage with RequestKey (an AppKey there draws a warning); older ones take an AppKey
_KEY = (web.RequestKey if hasattr(web, "RequestKey") else web.AppKey)("tandem_request_id", str)


def chosen_id(given: str | None) -> str:
    """The client's id when valid, else a new one (an invalid one is replaced, not refused)."""
    return given if given and is_valid_id(given) else new_request_id()


@web.middleware
async def http_request_ids(request: web.Request, handler):
    """Outermost middleware: the request's id is current while it is served; its access line at the end."""
    started = time.perf_counter()
    record, token = begin(chosen_id(request.headers.get(HEADER)), request.headers.get(TRACEPARENT, ""))
    request[_KEY] = record.request_id
    status: int | str = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as e:
        status = e.status
        raise
    except BaseException:
        status = 499 if request.transport is None or request.transport.is_closing() else 500
        raise
    finally:
        log_access(request.method, request.path, status, started, record, request.remote or "")
        end(token)


async def add_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the id goes out on every response, streamed ones before their first byte."""
    rid = request.get(_KEY)
    if rid:
        response.headers[HEADER] = rid


def add_request_ids(app: web.Application) -> None:
    """Install on an app whose middleware list starts with `http_request_ids`."""
    app.on_response_prepare.append(add_id_header)


class GrpcRequestIds(grpc.aio.ServerInterceptor):
    """Every call: its id current while it runs, sent back as initial metadata, one access line."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        metadata = dict(details.invocation_metadata or ())
        given = (metadata.get(METADATA), metadata.get(TRACEPARENT, ""))
        restore = not handler.response_streaming
        return around_calls(handler, lambda context: _recorded(context, given, details.method, restore))


def _failed_status(context) -> str:
    """The code a call that raised ends with: the one it aborted with, else CANCELLED (the client left)."""
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK else "CANCELLED"


@contextlib.asynccontextmanager
async def _recorded(context, given: tuple[str | None, str], method: str, restore: bool):
    """A call's id current while its body runs, sent back first, and its access line at the end.
    `given`: the client's id and traceparent from its metadata. `restore`: put the previous id back
    after (a unary call); a streaming call's task ends with it."""
    started = time.perf_counter()
    record, token = begin(chosen_id(given[0]), given[1])
    status = "OK"
    try:
        await context.send_initial_metadata(((METADATA, record.request_id),))
        yield
    except BaseException:
        status = _failed_status(context)
        raise
    finally:
        log_access("grpc", method, status, started, record, context.peer())
        if restore:
            end(token)
