"""Front door 2: HTTP. OpenAI-compatible endpoints (http_openai.py), the KServe v2 HTTP protocol for the
same model (http_kserve.py, so `tritonclient.http` works too), health and Prometheus metrics.

    GET  /health   /metrics   /v1/models               (and SageMaker's GET/POST /ping)
    POST /v1/completions   /v1/chat/completions      (SSE streaming with "stream": true; SageMaker's /invocations)
    POST /tokenize   /detokenize   GET /tokenizer_info   /version      (vLLM's, http_tokens.py)
    POST /v1/responses ... (http_responses.py)   POST /v1/messages[/count_tokens] (Anthropic's, http_anthropic.py)
    POST /v1/load_lora_adapter   /v1/unload_lora_adapter   (vLLM's, http_lora.py)
    GET  /v2/health/live   /v2/health/ready   /v2   /v2/models/{m}   /v2/models/{m}/ready   /v2/models/{m}/config
    POST /v2/models/{m}/infer                        (JSON tensors, or the binary tensor data extension)
    POST /v2/models/{m}/generate   /v2/models/{m}/generate_stream   GET /v2/models/{m}/stats   (http_generate.py)

Every failure, aiohttp's own 404, 405 and 413 included, is answered with the HTTP status of its tandem
status (tandem/status.py), a JSON body naming the problem (OpenAI's error shape; on the KServe v2
routes Triton's `{"error": "..."}`, on /v1/messages[/count_tokens] Anthropic's), and Retry-After when retrying may
help. A body over the size limit is refused (413) before it is read whole. A client that disconnects
cancels its request.
Under overload a generation request is refused before aiohttp sees it (frontdoor/http_gate.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections.abc import Callable

from aiohttp import web

from frontdoor import openai_api as oa
from frontdoor.api_keys import ApiKeys
from frontdoor.auth import http_middleware
from frontdoor.cors import Cors, CorsPolicy
from frontdoor.http_admin import add_admin_routes
from frontdoor.http_anthropic import add_anthropic_routes, error_type
from frontdoor.http_generate import add_generate_routes
from frontdoor.http_gate import RECEIVE_S, SEND_S, Gate, Turnstile, answered, arrived, generation_line, raw_response
from frontdoor.http_kserve import add_kserve_routes
from frontdoor.http_lora import LoraRoutes
from frontdoor.http_openai import add_openai_routes
from frontdoor.http_responses import add_responses_routes
from frontdoor.response_store import ResponseStore
from frontdoor.http_tokens import add_token_routes
from frontdoor.protocol_status import http_headers, http_status
from frontdoor.core import FrontDoor
from frontdoor.request_ids import add_request_ids, http_request_ids
from tandem.status import (Internal, InvalidArgument, MethodNotAllowed, NotFound, RequestTimeout, Status, TandemError,
                           TooLarge, status_of)

log = logging.getLogger("tandem.http")
MAX_BODY_BYTES = 16 << 20
SHUTDOWN_S = 1.0  # at stop, how long a request still streaming may take to end on its own, then to end cancelled

_KIND = {Status.INVALID_ARGUMENT: "invalid_request_error", Status.NOT_FOUND: "invalid_request_error",
         Status.METHOD_NOT_ALLOWED: "invalid_request_error", Status.TOO_LARGE: "invalid_request_error",
         Status.REQUEST_TIMEOUT: "invalid_request_error",
         Status.UNAUTHENTICATED: "authentication_error", Status.OUT_OF_PAGES: "rate_limit_error",
         Status.RESOURCE_EXHAUSTED: "rate_limit_error", Status.CANCELLED: "cancelled"}
# aiohttp's own refusals (raised before or instead of a handler), answered through the status table
_AIOHTTP = {400: InvalidArgument, 404: NotFound, 405: MethodNotAllowed, 413: TooLarge}


def is_kserve(path: str) -> bool:
    """KServe v2 routes answer errors in Triton's shape {"error": "..."}; /v1/messages in Anthropic's; every
    other route in OpenAI's."""
    return path == "/v2" or path.startswith("/v2/")


def error_parts(e: TandemError, path: str = "") -> tuple[int, dict[str, str], dict]:
    """The HTTP status, headers and JSON body that answer an error on route `path` (OpenAI's error shape,
    KServe's, or Anthropic's)."""
    status = status_of(e)
    if is_kserve(path):
        body = {"error": str(e)}
    elif path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"type": "error", "error": {"type": error_type(status), "message": str(e)}}
    else:
        body = oa.error_body(str(e), getattr(e, "param", None), _KIND.get(status, "server_error"))
        body["error"]["code"] = status.value
    return http_status(status), http_headers(status), body


def error_response(e: TandemError, path: str = "") -> web.Response:
    code, headers, body = error_parts(e, path)
    return web.json_response(body, status=code, headers=headers)


def raw_refusal(refuse_if_closed: Callable[[int], None], ahead: int, path: str = "") -> bytes | None:
    """The gate's answer (http_gate.py): the whole HTTP response `error_response` would give while
    `refuse_if_closed(ahead)` raises (`ahead` requests more than admission counts yet), else None."""
    try:
        refuse_if_closed(ahead)
    except TandemError as e:
        return raw_response(*error_parts(e, path))
    return None


class HttpFrontend:
    def __init__(self, door: FrontDoor, max_body_bytes: int = MAX_BODY_BYTES, keys: ApiKeys | None = None,
                 kept: ResponseStore | None = None, cors: Cors | None = None, lora: LoraRoutes | None = None):
        """`keys`: only callers holding one are served (frontdoor/auth.py); every request gets an id and an
        access line (frontdoor/request_ids.py). `kept`: the /v1/responses responses kept for follow-ups
        (frontdoor/response_store.py; None: none are). `cors`: which web pages of other origins may call
        (frontdoor/cors.py; None: none). `lora`: the routes loading LoRA adapters (frontdoor/http_lora.py)."""
        self.door, self.served = door, door.served
        self.service = door.service
        guard = [http_middleware(keys, error_response)] if keys is not None else []
        pages = CorsPolicy(cors or Cors())
        self.app = web.Application(client_max_size=max_body_bytes,
                                   middlewares=[http_request_ids, self._errors, *pages.middlewares(), *guard])
        pages.install(self.app)
        add_request_ids(self.app)
        r = self.app.router
        r.add_get("/health", self.health)
        for ping in (r.add_get, r.add_post):  # SageMaker's health check, as vLLM serves it
            ping("/ping", self.health)
        r.add_get("/metrics", self.metrics)
        add_openai_routes(r, door)
        kept = kept or ResponseStore(0)
        add_responses_routes(r, door, kept)  # /v1/responses (frontdoor/http_responses.py)
        add_anthropic_routes(r, door)  # /v1/messages (frontdoor/http_anthropic.py)
        self.app.on_shutdown.append(lambda _app: kept.close())  # background answers end at the stop
        add_kserve_routes(r, door)
        add_generate_routes(r, door)  # Triton's generate extension and /stats (frontdoor/http_generate.py)
        add_admin_routes(r, door.service)  # /admin/flush, /admin/workers (frontdoor/http_admin.py)
        add_token_routes(r, door)  # POST /tokenize, /detokenize, GET /version (frontdoor/http_tokens.py)
        if lora is not None:
            lora.add_to(r)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter

    @web.middleware
    async def _errors(self, request, handler):
        arrived(request)  # admission counts it from here on (see http_gate.Turnstile)
        try:
            return await self._answer(request, handler)
        finally:
            answered(request)  # the next request on this connection has limits.receive_timeout_s to arrive

    async def _answer(self, request, handler):
        path = request.path
        try:
            return await handler(request)
        except TandemError as e:
            resp = error_response(e, path)
            if status_of(e) is Status.REQUEST_TIMEOUT:  # refused before it was served: counted as such
                self.service.metrics.refused(Status.REQUEST_TIMEOUT)
                resp.force_close()  # the rest of its body may still be on its way: nothing more on this connection
            return resp
        except web.HTTPException as e:  # aiohttp's 404, 405, 413 ...: JSON through the status table too
            if e.status not in _AIOHTTP:
                raise
            allowed = sorted(getattr(e, "allowed_methods", None) or ())
            if e.status == 404:
                why = f"no such route: {request.method} {request.path}"
            elif allowed:
                why = f"method {request.method} is not allowed on {request.path}; allowed: {', '.join(allowed)}"
            else:
                why = f"{e.reason}: {request.method} {request.path}"
            resp = error_response(_AIOHTTP[e.status](why), path)
            if allowed:
                resp.headers["Allow"] = ", ".join(allowed)
            return resp
        except ConnectionError:  # the client went away while we answered: normal, not an error
            log.debug("client of %s went away", request.path)
            return web.Response(status=499)
        except Exception as e:  # a bug: 500 with the log holding the traceback, never a client error
            log.exception("internal error serving %s", request.path)
            return error_response(Internal(f"internal error ({type(e).__name__}); see the server log"), path)

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


async def start_http(frontend: HttpFrontend, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                     receive_s: float = RECEIVE_S, send_s: float = SEND_S) -> HttpServer:
    """Serve on host:port (TLS with `ssl_context`), each request given `receive_s` to arrive whole and
    each client `send_s` to read some of an answer held up (http_gate.py). OSError naming the address
    when it cannot listen."""
    # handler_cancellation: a client that disconnects cancels its handler, and with it the request;
    # shutdown_timeout: at stop (after the drain's grace) a request still streaming is cancelled within
    # 2 x SHUTDOWN_S (aiohttp's default, 60 s, let one stuck on a stopped worker hold the stop for 2 minutes)
    runner = web.AppRunner(frontend.app, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    line, turnstile = generation_line(frontend.served.triton_name), Turnstile()
    refusal = functools.partial(raw_refusal, frontend.service.refuse_if_closed)
    on_late = functools.partial(frontend.service.metrics.refused, Status.REQUEST_TIMEOUT)
    late = raw_response(*error_parts(RequestTimeout(f"the request head did not arrive within {receive_s:g} s of "
                                                    f"the connection's start or its previous answer (the "
                                                    f"deployment's limits.receive_timeout_s)")))
    try:
        listener = await asyncio.get_running_loop().create_server(
            lambda: Gate(runner.server(), line, turnstile, refusal, receive_s, late, on_late, send_s), host, port,
            ssl=ssl_context)
    except OSError as e:
        await runner.cleanup()
        raise OSError(e.errno, f"the HTTP front door cannot listen on {host}:{port}: {e.strerror}") from None
    return HttpServer(runner, listener)
