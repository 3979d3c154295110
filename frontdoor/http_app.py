"""Front door 2: HTTP. OpenAI-compatible endpoints (http_openai.py), the KServe v2 HTTP protocol for the
same model (http_kserve.py, so `tritonclient.http` works too), health and Prometheus metrics.

    GET  /health   /metrics   /v1/models
    POST /v1/completions   /v1/chat/completions      (SSE streaming with "stream": true)
    GET  /v2/health/live   /v2/health/ready   /v2   /v2/models/{m}   /v2/models/{m}/ready   /v2/models/{m}/config
    POST /v2/models/{m}/infer                        (JSON tensors, or the binary tensor data extension)
    POST /v2/models/{m}/generate   /v2/models/{m}/generate_stream   GET /v2/models/{m}/stats   (http_generate.py)

Every failure is answered with the HTTP status of its tandem status (tandem/status.py), an
OpenAI-style error body naming the problem, and Retry-After when retrying may help. A body over the
size limit is refused (413) before it is read whole. A client that disconnects cancels its request.
Under overload a generation request is refused before aiohttp sees it (frontdoor/http_gate.py).
"""

from __future__ import annotations

import asyncio
import http
import functools
import logging
from collections.abc import Callable

from aiohttp import web

from frontdoor import openai_api as oa
from frontdoor.http_admin import add_admin_routes
from frontdoor.http_generate import add_generate_routes
from frontdoor.http_gate import Gate, Turnstile, arrived, generation_line, raw_response
from frontdoor.http_kserve import add_kserve_routes
from frontdoor.http_openai import add_openai_routes
from frontdoor.protocol_status import http_headers, http_status
from frontdoor.served_model import ServedModel
from tandem.status import Internal, Status, TandemError, status_of

log = logging.getLogger("tandem.http")
MAX_BODY_BYTES = 16 << 20

_KIND = {Status.INVALID_ARGUMENT: "invalid_request_error", Status.NOT_FOUND: "invalid_request_error",
         Status.UNAUTHENTICATED: "authentication_error", Status.OUT_OF_PAGES: "rate_limit_error",
         Status.RESOURCE_EXHAUSTED: "rate_limit_error", Status.CANCELLED: "cancelled"}


def error_parts(e: TandemError) -> tuple[int, dict[str, str], dict]:
    """The HTTP status, headers and OpenAI-style JSON body that answer an error."""
    status = status_of(e)
    body = oa.error_body(str(e), getattr(e, "param", None), _KIND.get(status, "server_error"))
    body["error"]["code"] = status.value
    return http_status(status), http_headers(status), body


def error_response(e: TandemError) -> web.Response:
    code, headers, body = error_parts(e)
    return web.json_response(body, status=code, headers=headers)


def http_exception_response(request, e: web.HTTPException) -> web.Response:
    """aiohttp's 404, 405 and the like answered as every other error: an OpenAI-style JSON body."""
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        message = f"method {request.method} is not allowed on {request.path}; allowed: {allowed}"
    elif isinstance(e, web.HTTPNotFound):
        message = f"no such route: {request.method} {request.path}"
    else:
        message = f"{e.reason} ({request.method} {request.path})"
    body = oa.error_body(message, None, "invalid_request_error" if e.status < 500 else "server_error")
    body["error"]["code"] = http.HTTPStatus(e.status).name
    headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
    return web.json_response(body, status=e.status, headers=headers)


def raw_refusal(refuse_if_closed: Callable[[int], None], ahead: int) -> bytes | None:
    """The gate's answer (http_gate.py): the whole HTTP response `error_response` would give while
    `refuse_if_closed(ahead)` raises (`ahead` requests more than admission counts yet), else None."""
    try:
        refuse_if_closed(ahead)
    except TandemError as e:
        return raw_response(*error_parts(e))
    return None


class HttpFrontend:
    def __init__(self, served: ServedModel, max_body_bytes: int = MAX_BODY_BYTES):
        self.served = served
        self.service = served.service
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._errors])
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        add_openai_routes(r, served)
        add_kserve_routes(r, served)
        add_generate_routes(r, served)  # Triton's generate extension and /stats (frontdoor/http_generate.py)
        add_admin_routes(r, served)  # POST /admin/flush (frontdoor/http_admin.py)

    @web.middleware
    async def _errors(self, request, handler):
        arrived(request)  # admission counts it from here on (see http_gate.Turnstile)
        try:
            return await handler(request)
        except TandemError as e:
            return error_response(e)
        except web.HTTPException as e:  # aiohttp's own answers (no route, wrong method): OpenAI's error shape
            if e.status < 400:
                raise
            return http_exception_response(request, e)
        except ConnectionError:  # the client went away while we answered: normal, not an error
            log.debug("client of %s went away", request.path)
            return web.Response(status=499)
        except Exception as e:  # a bug: 500 with the log holding the traceback, never a client error
            log.exception("internal error serving %s", request.path)
            return error_response(Internal(f"internal error ({type(e).__name__}); see the server log"))

    async def health(self, request):
        ok = self.service.ready()
        return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

    async def metrics(self, request):
        return web.Response(body=self.service.metrics.render(), content_type="text/plain", charset="utf-8")


class HttpServer:
    """The listening socket (each connection behind a Gate) and aiohttp's runner behind it."""

    def __init__(self, runner: web.AppRunner, listener: asyncio.Server):
        self.runner, self.listener = runner, listener

    async def cleanup(self) -> None:
        self.listener.close()  # no new connection; the runner then ends the open ones
        await self.runner.cleanup()


async def start_http(frontend: HttpFrontend, host: str, port: int) -> HttpServer:
    # handler_cancellation: a client that disconnects cancels its handler, and with it the request
    runner = web.AppRunner(frontend.app, access_log=None, handler_cancellation=True)
    await runner.setup()
    line, turnstile = generation_line(frontend.served.triton_name), Turnstile()
    refusal = functools.partial(raw_refusal, frontend.service.refuse_if_closed)
    listener = await asyncio.get_running_loop().create_server(
        lambda: Gate(runner.server(), line, turnstile, refusal), host, port)
    return HttpServer(runner, listener)
