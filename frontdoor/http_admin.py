"""Operator routes on the HTTP front door.

    POST /admin/flush    every routable worker drops its prefix cache's idle pages (pages of requests
                         in flight keep theirs); answers {"flushed": [...], "failed": {worker: why}}
    GET /admin/workers   every worker the orchestrator knows: its role, address, state (routable,
                         draining, not ready and why), our load on it and what it last reported;
                         with `ready` and, for each role lacking a routable worker, why (`not_ready`)

Who may call them: with a deployment secret set (tandem/secret.py), only a caller that presents it as
`Authorization: Bearer <secret>`; without one, only a caller on loopback. A flush never changes an
answer (a cache only saves work), but it costs every user the cache, so it is not for everyone.
"""

from __future__ import annotations

import asyncio
import hmac

from aiohttp import web

from control.orchestrator import Orchestrator
from tandem.secret import is_loopback, load_secret
from tandem.status import TandemError, Unauthenticated


def add_admin_routes(router, service: Orchestrator) -> None:
    routes = AdminRoutes(service)
    router.add_post("/admin/flush", routes.flush)
    router.add_get("/admin/workers", routes.workers)


class AdminRoutes:
    def __init__(self, service: Orchestrator):
        self.path, self.fleet, self.mode = service.path, service.path.fleet, service.mode
        self.secret = load_secret()

    def _authorize(self, request: web.Request) -> None:
        if self.secret is None:
            if not is_loopback(request.remote or ""):
                raise Unauthenticated("admin routes answer only callers on loopback when no deployment secret "
                                      "is set (set TANDEM_SECRET_FILE and send 'Authorization: Bearer <secret>')")
            return
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.secret.encode()):
            raise Unauthenticated("admin routes need the deployment secret: 'Authorization: Bearer <secret>'")

    async def flush(self, request: web.Request) -> web.Response:
        self._authorize(request)
        workers = [w for w in self.fleet.workers.values() if w.routable]
        results = await asyncio.gather(*(self._flush_one(w) for w in workers))
        failed = {w.name: why for w, why in zip(workers, results) if why is not None}
        body = {"flushed": sorted(w.name for w in workers if w.name not in failed), "failed": failed}
        return web.json_response(body, status=503 if failed else 200)

    async def workers(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response({"mode": str(self.mode), "ready": self.path.ready(),
                                  "not_ready": self.fleet.why_not_ready(self.path.roles),
                                  "workers": [w.report() for w in sorted(self.fleet.workers.values(),
                                                                         key=lambda w: (w.role, w.name))]})

    @staticmethod
    async def _flush_one(w) -> str | None:
        """None when the worker flushed; else why not (the others are flushed regardless)."""
        try:
            await w.client.flush()
        except TandemError as e:
            return f"{e.status.value}: {e}"
        return None
