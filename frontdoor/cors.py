"""Calls from web pages of other origins (CORS) on the HTTP front door, as vLLM's --allowed-origins.

Off by default (`allowed_origins` empty): no response says an origin may read it, so a page served from
elsewhere cannot use the door (its browser refuses the answer). `front_door.cors.allowed_origins`
(`tandem serve --allowed-origins '["https://chat.example.com"]'`, `["*"]` for any) lets those pages call
every route, as the Fetch standard has browsers ask:

- A preflight (OPTIONS with `Origin` and `Access-Control-Request-Method`) is answered here, before any
  key is asked for (a browser sends none with it): 204 with the methods and headers allowed
  (`allowed_methods`, `allowed_headers`; `["*"]`, the default, allows what was asked, `Authorization`
  included) for 600 s, or a 400 naming the origin, method or header that is not allowed.
- Every other response to an allowed origin, errors, 401s and streams included, says
  `Access-Control-Allow-Origin` (the origin itself; `*` where any is allowed and credentials are not),
  `Vary: Origin`, and exposes `X-Request-Id` and `Retry-After` to the page. `allow_credentials` adds
  `Access-Control-Allow-Credentials: true` (cookies and TLS client certificates then go along; the
  origin is always named, never `*`).

A request from a page of an origin not allowed is still served as any other (CORS is the browser's
check, not an access control: API keys are); only the headers that would let the page read it are
left out.
"""

from __future__ import annotations

import re

from aiohttp import web
from pydantic import BaseModel, ConfigDict, field_validator

from tandem.status import InvalidArgument

MAX_AGE_S = 600
_ORIGIN = re.compile(r"https?://[^/\s?#]+")  # scheme://host[:port], no path
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP method or header name
_EXPOSED = "X-Request-Id, Retry-After"


class Cors(BaseModel):
    """front_door.cors in the deployment file."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    allowed_origins: list[str] = []  # e.g. ["https://chat.example.com"]; ["*"]: any; []: none (CORS off)
    allowed_methods: list[str] = ["*"]  # what a preflight may ask for; ["*"]: any
    allowed_headers: list[str] = ["*"]
    allow_credentials: bool = False

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for o in origins:
            if o != "*" and not _ORIGIN.fullmatch(o):
                raise ValueError(f"origin {o!r} must be \"*\" or scheme://host[:port] (http or https, no path), as "
                                 f"a browser sends it in Origin")
        return origins

    @field_validator("allowed_methods", "allowed_headers")
    @classmethod
    def _tokens(cls, names: list[str]) -> list[str]:
        for n in names:
            if not _TOKEN.fullmatch(n):
                raise ValueError(f"{n!r} is not an HTTP method or header name")
        return names


class CorsPolicy:
    """A Cors setting applied to one aiohttp application (`middlewares` and `install`)."""

    def __init__(self, cors: Cors):
        self.cors = cors
        self.any_origin = "*" in cors.allowed_origins
        self.methods = {m.upper() for m in cors.allowed_methods}
        self.headers = {h.lower() for h in cors.allowed_headers}

    def middlewares(self) -> list:
        """The middleware that answers preflights (none when CORS is off): after the error middleware
        (a refusal is an error like any other), before the key check."""
        return [self._preflight] if self.cors.allowed_origins else []

    def install(self, app: web.Application) -> None:
        """Have every response of `app` say that its origin may read it, where it may."""
        if self.cors.allowed_origins:
            app.on_response_prepare.append(self._headers)

    def allowed(self, origin: str) -> bool:
        return self.any_origin or origin in self.cors.allowed_origins

    @web.middleware
    async def _preflight(self, request: web.Request, handler):
        origin, method = request.headers.get("Origin"), request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or method is None:
            return await handler(request)
        if not self.allowed(origin):
            raise InvalidArgument(f"CORS: origin {origin!r:.100} is not allowed on this server (allowed: "
                                  f"{', '.join(self.cors.allowed_origins)})")
        if "*" not in self.methods and method.upper() not in self.methods:
            raise InvalidArgument(f"CORS: method {method!r:.40} is not allowed (allowed: "
                                  f"{', '.join(sorted(self.methods))})")
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        refused = [h for h in asked if "*" not in self.headers and h.lower() not in self.headers]
        if refused:
            raise InvalidArgument(f"CORS: header {refused[0]!r:.60} is not allowed (allowed: "
                                  f"{', '.join(sorted(self.headers))})")
        methods = method.upper() if "*" in self.methods else ", ".join(sorted(self.methods))
        headers = {"Access-Control-Allow-Methods": methods, "Access-Control-Max-Age": str(MAX_AGE_S)}
        if asked:
            headers["Access-Control-Allow-Headers"] = ", ".join(asked)
        return web.Response(status=204, headers=headers)

    async def _headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Before any response's headers are sent (a stream's included): the CORS headers of its origin."""
        origin = request.headers.get("Origin")
        if origin is None or not self.allowed(origin):
            return
        named = self.cors.allow_credentials or not self.any_origin
        response.headers["Access-Control-Allow-Origin"] = origin if named else "*"
        if self.cors.allow_credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers["Access-Control-Expose-Headers"] = _EXPOSED
        vary = response.headers.get("Vary")
        if named and "origin" not in (vary or "").lower():
            response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
