"""The workers the orchestrator routes to: their clients, health and load, and a change signal.

Each worker is watched through one long-lived Watch call: the worker pushes its stats on every change
and as a heartbeat (ending the call every WATCH_RENEW_AFTER pushes with a `renew` reply, upon which the
watch begins again at once). Nothing for `stall_s` (a stopped or wedged process) or a broken stream (a
dead one) takes it out of routing at once; the watch reconnects with back-off, and the worker rejoins when
it answers again. Workers can be added and removed while serving (a supervisor restarting one on new
ports, DNS discovery, a reloaded deployment): a removed worker gets no new requests, and its client
closes once the requests it still serves are done.

`changed` is a version counter with a condition: a request waiting for pages (or for any healthy
worker) sleeps until some worker's state changes or its deadline passes, never on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field

from control.worker_client import CLIENTS, DecodeClient
from tandem.call_renewal import ANSWER_RENEW_AFTER, WATCH_RENEW_AFTER
from tandem.roles import Role
from tandem.status import TandemError
from tandem.wire import WorkerStats

log = logging.getLogger("tandem.fleet")


@dataclass(eq=False)
class WorkerState:
    name: str
    role: Role  # given when the worker joins (Fleet.add), never parsed from its name
    url: str
    client: object
    healthy: bool = False
    draining: bool = False  # removed: finishes what it has, gets nothing new
    stats: WorkerStats | None = None
    last_seen: float = 0.0
    inflight_tokens: int = 0  # our own count: prompt tokens sent and not yet answered (prefill)
    running: int = 0  # our own count: requests holding pages or streaming (decode, generate)
    holds: int = 0  # our own count: pull holds on this prefill worker's pages not yet ended (control/pull_attempt.py)
    failures: int = 0  # consecutive failed watch connections
    why_not: str = ""  # why its last watch failed ("" until one did, and once it answers again)
    slot: str = ""  # stable name for metrics: <role>-<n>, the lowest n free when it joined (an address is not)
    watcher: asyncio.Task | None = field(default=None, repr=False)

    @property
    def host(self) -> str:
        return self.stats.host if self.stats is not None else ""

    @property
    def pages_free(self) -> int | None:
        s = self.stats
        return None if s is None or not s.pages_total else s.pages_total - s.pages_used

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    def report(self) -> dict:
        """What an operator sees of this worker (GET /admin/workers): our view of it (state, why it is not
        ready, our own load counts) and the load it last reported (None before its first report)."""
        s = self.stats
        reported = None if s is None else {k: getattr(s, k) for k in _REPORTED}
        return {"name": self.name, "slot": self.slot, "role": self.role.value, "url": self.url,
                "state": "draining" if self.draining else "routable" if self.healthy else "not ready",
                "why_not": self.why_not, "failures": self.failures,
                "heard_s_ago": round(time.monotonic() - self.last_seen, 1) if self.last_seen else None,
                "running": self.running, "prompt_tokens_sent": self.inflight_tokens, "pull_holds": self.holds,
                "reported": reported}


_REPORTED = ("host", "pages_total", "pages_used", "pages_cached", "pages_fenced", "pages_held", "running", "reserved",
             "queued_tokens", "cache_hits", "cache_misses", "cache_evictions", "lora_adapters")


class Fleet:
    def __init__(self, heartbeat_s: float = 1.0, stall_s: float = 3.0, auth: tuple = (), on_change=None,
                 on_stats=None, tls=None, clients=None, tokens_per_call: int = ANSWER_RENEW_AFTER):
        """`auth`: request parameters every call carries (the secret); `tls`: a control.worker_tls.WorkerTls;
        `clients`: the client class per role (control/worker_client.py; default CLIENTS, Tandem's engines);
        `tokens_per_call`: an answer's tokens per call to its decode worker (DecodeClient.renew_after)."""
        self.clients = clients or CLIENTS
        self.heartbeat_s, self.stall_s, self.auth, self.tls = heartbeat_s, stall_s, auth, tls
        self.tokens_per_call = tokens_per_call
        self.workers: dict[str, WorkerState] = {}
        self.version = 0
        self._cond = asyncio.Condition()
        self.on_change = on_change  # callback(worker) after a health change (metrics, supervisor)
        self.on_stats = on_stats  # callback(worker) after every stats push (metrics)
        self.on_join = None  # async callback(worker) before a worker is routed to; its TandemError keeps it out
        self.owner = secrets.token_hex(8)  # this orchestrator, to its workers (Watch, Adapters)
        self.renew_after = WATCH_RENEW_AFTER  # replies per Watch call (tandem/call_renewal.py)

    def role(self, role: Role) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role]

    def routable(self, role: Role) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.role == role and w.routable]

    def ready(self, roles: tuple[Role, ...]) -> bool:
        return all(self.routable(r) for r in roles)

    def why_not_ready(self, roles: tuple[Role, ...]) -> list[str]:
        """For each of `roles` with no routable worker, why: each of its workers and its last failure."""
        return [f"no {r} worker" + "".join(f"; {w.name} at {w.url}: {w.why_not or 'no answer yet'}"
                                           for w in self.role(r))
                for r in roles if not self.routable(r)]

    def add(self, name: str, role: Role | str, url: str) -> WorkerState:
        """Route to the worker at `url` serving `role` (a Role or its word; ValueError for another word)."""
        if name in self.workers:
            raise ValueError(f"worker {name!r} is already in the fleet")
        role = Role.parse(role)
        w = WorkerState(name, role, url, self.clients[role](url, self.auth, self.tls), slot=self._free_slot(name, role))
        if isinstance(w.client, DecodeClient):
            w.client.renew_after = self.tokens_per_call
        self.workers[name] = w
        w.watcher = asyncio.get_running_loop().create_task(self._watch(w), name=f"watch-{name}")
        return w

    def _free_slot(self, name: str, role: Role) -> str:
        """A local worker's own name (prefill-0, ...) is its slot; a remote one (role@address) gets the
        lowest `role-rN` no other worker holds, so a restarted pod at a new address takes its place."""
        if "@" not in name:
            return name
        taken = {w.slot for w in self.workers.values()}
        return next(s for n in itertools.count() if (s := f"{role}-r{n}") not in taken)

    async def replace(self, name: str, url: str) -> WorkerState:
        """A worker restarted elsewhere (new ports): route to the new one under the same name. Calls still
        on the old one fail (its process is gone) and resume; its client is closed."""
        old = self.workers.pop(name)
        new = self.add(name, old.role, url)
        await self._close(old)
        await self._bump()
        return new

    async def remove(self, name: str) -> None:
        """Drain a worker out: no new requests; its client closes when its last request is done."""
        w = self.workers.get(name)
        if w is None:
            return
        w.draining = True
        await self._bump()
        while w.running or w.inflight_tokens or w.holds:  # each end changes its stats, which wakes us
            await self.wait_change(self.version, time.monotonic() + 3600)
        self.workers.pop(name, None)
        await self._close(w)

    async def _close(self, w: WorkerState) -> None:
        if w.watcher is not None:
            w.watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w.watcher
        await w.client.close()

    async def _watch(self, w: WorkerState) -> None:
        backoff = 0.25
        while True:
            stats = None
            try:
                async for stats in w.client.watch(self.heartbeat_s, self.stall_s, self.owner, self.renew_after):
                    w.stats, w.last_seen, w.failures, w.why_not, backoff = stats, time.monotonic(), 0, "", 0.25
                    if self.on_stats is not None:
                        self.on_stats(w)
                    if not w.healthy:
                        if self.on_join is not None:
                            await self.on_join(w)  # e.g. the LoRA adapters it must hold (control/adapters.py)
                        w.healthy = True
                        log.info("worker %s (%s) at %s is ready", w.name, w.role, w.url)
                        self._changed(w)
                    await self._bump()
            except TandemError as e:
                why = str(e)
            else:
                if stats is not None and stats.renew:
                    continue  # the worker ended this call to free what Triton kept of it: watch again
                why = "it ended its watch (shutting down?)"
            w.failures += 1
            w.client.reset(why)  # calls waiting on a stalled worker fail now and resume elsewhere
            if w.healthy:
                w.healthy = False
                log.warning("worker %s (%s) at %s left routing: %s", w.name, w.role, w.url, why)
                self._changed(w)
            elif why != w.why_not:  # once per reason, not per retry: a worker that never answered says why
                log.warning("worker %s (%s) at %s is not ready: %s (retrying)", w.name, w.role, w.url, why)
            w.why_not = why
            await self._bump()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _changed(self, w: WorkerState) -> None:
        if self.on_change is not None:
            self.on_change(w)

    def mark_unreachable(self, w: WorkerState, why: str) -> None:
        """A request found the worker unreachable: out of routing now (its watch decides when it is back)."""
        if w.healthy:
            w.healthy = False
            log.warning("worker %s (%s) left routing: %s", w.name, w.role, why)
            self._changed(w)
            self.poke()

    def poke(self) -> None:
        """Signal a change from synchronous code (own load accounting, health)."""
        asyncio.get_running_loop().create_task(self._bump())

    async def _bump(self) -> None:
        async with self._cond:
            self.version += 1
            self._cond.notify_all()

    async def wait_change(self, version: int, deadline: float) -> bool:
        """Sleep until the version moves past `version` or `deadline` (monotonic). False on the deadline."""
        try:
            async with asyncio.timeout_at(deadline), self._cond:  # monotonic, like the loop's clock
                await self._cond.wait_for(lambda: self.version != version)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        for w in list(self.workers.values()):
            await self._close(w)
        self.workers.clear()
