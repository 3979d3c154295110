"""API keys on both front doors: who may use them, and who each request's caller is.

The keys, and the names of their holders, are read by frontdoor/api_keys.py. A client presents a key as
`Authorization: Bearer <key>`: the HTTP header (or `x-api-key: <key>`, Anthropic's clients' header), or
the gRPC metadata entry `authorization`. Without a valid key a request is answered 401 (the route's
error JSON) or gRPC UNAUTHENTICATED, before its body is looked at. Every configured key is compared in
constant time, all of them every time.

Open without a key, when `open_probes` (the default): the probes, `/health`, `/ping`, `/metrics`,
`/v2/health/*` and gRPC ServerLive/ServerReady/ModelReady, so load balancers, kubelets and Prometheus
need no key. `/admin/*` has its own stronger rule (the deployment secret, frontdoor/http_admin.py).

A door that listens beyond loopback needs keys unless they are switched off explicitly
(`--no-api-key`); `api_keys.resolve_keys` refuses to start otherwise.

An accepted request's caller (tandem/request_context.py: the key's name, for the access log and the
per-key metrics, and its cache scope under per-key isolation, which the front-door core turns into the
request's cache salt, tandem/prefix.scoped_salt) is set before the request is served, on both doors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import grpc
from aiohttp import web

from frontdoor.api_keys import ApiKeys, Caller
from frontdoor.grpc_calls import around_calls, behavior_kind
from tandem.request_context import set_caller
from tandem.status import TandemError, Unauthenticated

OPEN_HTTP_PATHS = ("/health", "/ping", "/metrics", "/v2/health/live", "/v2/health/ready")
OPEN_GRPC_METHODS = ("ServerLive", "ServerReady", "ModelReady")
_HINT = "send 'Authorization: Bearer <key>' with a key this server was given (TANDEM_API_KEY or --api-key-file)"


def refusal(authorization: str | None) -> Unauthenticated:
    """The error for a request whose `authorization` names no configured key."""
    why = "no API key was sent" if not authorization else "the API key is not valid"
    return Unauthenticated(f"{why}; {_HINT}")


def http_middleware(keys: ApiKeys, respond: Callable[[TandemError, str], web.StreamResponse]):
    """aiohttp middleware: a request without a valid key is answered `respond(Unauthenticated, its path)`.
    The key comes as `Authorization: Bearer <key>`, or as `x-api-key: <key>` (Anthropic's clients)."""

    @web.middleware
    async def require_key(request: web.Request, handler):
        path = request.path
        exempt = path.startswith("/admin/") or (keys.open_probes and path in OPEN_HTTP_PATHS)
        if not exempt:
            given = request.headers.get("Authorization")
            if given is None and request.headers.get("x-api-key"):
                given = f"Bearer {request.headers['x-api-key']}"
            caller = keys.caller(given)
            if caller is None:
                resp = respond(refusal(given), path)
                resp.headers["WWW-Authenticate"] = 'Bearer realm="tandem"'
                return resp
            set_caller(caller.name, caller.scope)  # inside frontdoor/request_ids.py's middleware, same task
        return await handler(request)

    return require_key


class GrpcKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every call needs metadata `authorization: Bearer <key>`, except the probes (when open)."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        if handler is None or (self.keys.open_probes and method in OPEN_GRPC_METHODS):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization")
        caller = self.keys.caller(given)
        if caller is None:
            return _refusing(handler, str(refusal(given)))
        return around_calls(handler, lambda context: _called_by(caller))


@contextlib.asynccontextmanager
async def _called_by(caller: Caller):
    """A call's request (begun by frontdoor/request_ids.py, the outer interceptor) is `caller`'s."""
    set_caller(caller.name, caller.scope)
    yield


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts every call with UNAUTHENTICATED."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached (abort raises): it makes this an async generator, as a streaming handler is

    return handler._replace(**{behavior_kind(handler): refuse_stream if handler.response_streaming else refuse})
