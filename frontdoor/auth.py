"""API keys on both front doors: who may use them.

Keys come from `TANDEM_API_KEY` (one key) and/or a key file (one key per line; blank lines and `#`
comments skipped), so several keys can be valid at once while one is rotated. A client presents one
as `Authorization: Bearer <key>`: the HTTP header, or the gRPC metadata entry `authorization`.
Without a valid key a request is answered 401 (OpenAI's error JSON) or gRPC UNAUTHENTICATED, before
its body is looked at. Every configured key is compared in constant time, all of them every time.

Open without a key, when `open_probes` (the default): the probes, `/health`, `/metrics`,
`/v2/health/*` and gRPC ServerLive/ServerReady/ModelReady, so load balancers, kubelets and Prometheus
need no key. `/admin/*` has its own stronger rule (the deployment secret, frontdoor/http_admin.py).

A door that listens beyond loopback needs keys unless they are switched off explicitly
(`--no-api-key`); `resolve_keys` refuses to start otherwise.

Keys are read again on SIGHUP (ops/stack.py: `Stack.reload`), so a key is added and retired without a
restart: add the new one to the file, reload, move clients over, remove the old one, reload. A reload
that would leave no keys, or keys that fail the rules above, is refused and the running keys kept.

Per-key prefix-cache isolation (`prefix_cache.per_api_key`): each request is scoped to the key it
presented (`key_scope`: a digest of the key, never the key), and the front-door core serves it under a
cache salt within that scope (tandem/prefix.scoped_salt), so one key's cached prompts never serve, nor
can be timed by, another key's requests. It needs keys; a rotated key starts a scope of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from aiohttp import web

from frontdoor.grpc_calls import around_calls, behavior_kind
from tandem.request_context import set_cache_scope
from tandem.secret import is_loopback
from tandem.status import TandemError, Unauthenticated

ENV_KEY = "TANDEM_API_KEY"
MIN_KEY_CHARS = 8
OPEN_HTTP_PATHS = ("/health", "/metrics", "/v2/health/live", "/v2/health/ready")
OPEN_GRPC_METHODS = ("ServerLive", "ServerReady", "ModelReady")
_HINT = "send 'Authorization: Bearer <key>' with a key this server was given (TANDEM_API_KEY or --api-key-file)"


class ApiKeyError(ValueError):
    """Keys are configured wrongly: the message says what and how to fix it."""


@dataclass
class ApiKeys:
    """The doors' keys. `keys` may be replaced while serving (`rotate`, on SIGHUP); every request reads
    the set once, so it is checked against the old set or the new one, never a mix."""

    keys: tuple[bytes, ...]
    open_probes: bool = True
    per_key_cache: bool = False  # each key's requests share cached prefixes only among themselves

    def rotate(self, new: "ApiKeys | None") -> str:
        """Take the keys of `new` (the deployment's keys read again); returns what changed, in words
        (never a key). Raises ApiKeyError when `new` would switch keys off or change a rule that only
        a restart changes (open probes, per-key caching): the running keys are then kept."""
        if new is None:
            raise ApiKeyError("the reloaded deployment has no API keys; switching them off needs a restart")
        if (new.open_probes, new.per_key_cache) != (self.open_probes, self.per_key_cache):
            raise ApiKeyError("front_door.open_probes and prefix_cache.per_api_key change only with a restart")
        kept = len(set(new.keys) & set(self.keys))
        said = f"{len(new.keys)} API keys ({len(new.keys) - kept} new, {len(self.keys) - kept} removed)"
        self.keys = new.keys
        return said

    def accepted(self, authorization: str | None) -> bytes | None:
        """The key when `authorization` is 'Bearer <a configured key>', else None. Compares against every key."""
        scheme, _, given = (authorization or "").strip().partition(" ")
        token = given.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(token, key)
        return token if ok and token else None

    def scope(self, key: bytes) -> str:
        """The cache scope of requests that present `key` ("": none, when keys are not isolated)."""
        return key_scope(key) if self.per_key_cache else ""


def refusal(authorization: str | None) -> Unauthenticated:
    """The error for a request whose `authorization` names no configured key."""
    why = "no API key was sent" if not authorization else "the API key is not valid"
    return Unauthenticated(f"{why}; {_HINT}")


def key_scope(key: bytes) -> str:
    """The cache scope of the requests that present `key`: 'key-' and 32 hex digits of its BLAKE2b digest."""
    return "key-" + hashlib.blake2b(key, digest_size=16, person=b"tandem-api-key").hexdigest()


def read_keys(key_file: str | None, environ=os.environ) -> tuple[bytes, ...]:
    """The keys of TANDEM_API_KEY and of `key_file`; each at least MIN_KEY_CHARS long."""
    keys = []
    if environ.get(ENV_KEY):
        keys.append(environ[ENV_KEY].strip())
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as f:
                keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        except OSError as e:
            raise ApiKeyError(f"cannot read the API key file {key_file}: {e.strerror}") from None
    for k in keys:
        if len(k) < MIN_KEY_CHARS or any(c.isspace() for c in k):
            raise ApiKeyError(f"an API key must be at least {MIN_KEY_CHARS} characters with no spaces "
                              f"(e.g. `head -c 24 /dev/urandom | base64`)")
    return tuple(k.encode() for k in keys)


def resolve_keys(host: str, key_file: str | None, disabled: bool, open_probes: bool = True,
                 per_key_cache: bool = False, environ=os.environ) -> ApiKeys | None:
    """The keys the doors on `host` require, or None (no keys). Off loopback, keys are required unless
    `disabled`; keys given while `disabled` is a contradiction, refused too; so is `per_key_cache`
    (prefix-cache isolation per key) without keys."""
    keys = read_keys(key_file, environ)
    if per_key_cache and (disabled or not keys):
        raise ApiKeyError("prefix_cache.per_api_key isolates cached prefixes per API key and no keys are "
                          "configured: set TANDEM_API_KEY or --api-key-file, or leave per_api_key off")
    if disabled:
        if keys:
            raise ApiKeyError("API keys are given (TANDEM_API_KEY or an API key file) and switched off "
                              "(--no-api-key) at once; choose one")
        return None
    if not keys:
        if not is_loopback(host):
            raise ApiKeyError(f"the front doors listen on {host}, beyond loopback, without API keys: set "
                              f"TANDEM_API_KEY or --api-key-file, or pass --no-api-key to serve without keys")
        return None
    return ApiKeys(keys, open_probes, per_key_cache)


def http_middleware(keys: ApiKeys, respond: Callable[[TandemError], web.StreamResponse]):
    """aiohttp middleware: a request without a valid key is answered `respond(Unauthenticated)`."""

    @web.middleware
    async def require_key(request: web.Request, handler):
        path = request.path
        exempt = path.startswith("/admin/") or (keys.open_probes and path in OPEN_HTTP_PATHS)
        if not exempt:
            given = request.headers.get("Authorization")
            key = keys.accepted(given)
            if key is None:
                resp = respond(refusal(given))
                resp.headers["WWW-Authenticate"] = 'Bearer realm="tandem"'
                return resp
            scope = keys.scope(key)
            if scope:  # this middleware runs inside frontdoor/request_ids.py's, in the same task
                set_cache_scope(scope)
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
        key = self.keys.accepted(given)
        if key is None:
            return _refusing(handler, str(refusal(given)))
        scope = self.keys.scope(key)
        return around_calls(handler, lambda context: _scoped(scope)) if scope else handler


@contextlib.asynccontextmanager
async def _scoped(scope: str):
    """A call's request (begun by frontdoor/request_ids.py, the outer interceptor) is scoped to `scope`."""
    set_cache_scope(scope)
    yield


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts every call with UNAUTHENTICATED."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached (abort raises): it makes this an async generator, as a streaming handler is

    return handler._replace(**{behavior_kind(handler): refuse_stream if handler.response_streaming else refuse})
