"""Remote workers: the ones a deployment lists by address, and the ones a DNS name resolves to.

The fleet's remote workers follow the deployment: every `urls` entry, and every address a `dns` name
resolves to (a Kubernetes headless Service has one A record per ready pod), re-resolved every
`refresh_s`. A worker that appears is added (it joins routing when its watch connects); one that
disappears is drained: no new requests, and it leaves once the requests it serves are done. A new
deployment file (SIGHUP to `tandem serve`) is applied the same way.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from control.fleet import Fleet
from tandem.modes import Mode
from tandem.roles import Role

log = logging.getLogger("tandem.discovery")
ROLES = (Role.PREFILL, Role.DECODE)  # the roles a deployment may list remote workers for


def remote_name(role: str, url: str) -> str:
    return f"{role}@{url}"


class Discovery:
    def __init__(self, fleet: Fleet, refresh_s: float = 5.0):
        self.fleet, self.refresh_s = fleet, refresh_s
        self.pools: dict = {}
        self._task: asyncio.Task | None = None
        self._draining: set[asyncio.Task] = set()

    async def start(self, dep) -> None:
        await self.apply(dep)
        if any(getattr(dep, r).dns for r in ROLES) and dep.mode is Mode.DISAGGREGATED:
            self._task = asyncio.get_running_loop().create_task(self._refresh())

    async def apply(self, dep) -> None:
        """Make the fleet's remote workers what `dep` names (local workers are the stack's own)."""
        self.pools = {r: getattr(dep, r) for r in ROLES} if dep.mode is Mode.DISAGGREGATED else {}
        await self.sync()

    async def sync(self) -> None:
        """Add the workers the pools name now and drain the ones they no longer name."""
        want = {remote_name(role, url): (role, url) for role, url in await self._wanted()}
        have = {n for n in self.fleet.workers if "@" in n}
        for name in sorted(set(want) - have):
            role, url = want[name]
            log.info("adding remote %s worker %s", role, url)
            self.fleet.add(name, role, url)
        for name in sorted(have - set(want)):
            log.info("draining remote worker %s: it is no longer in the deployment", name)
            task = asyncio.get_running_loop().create_task(self.fleet.remove(name))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    async def _wanted(self) -> list[tuple[str, str]]:
        out = []
        for role, pool in self.pools.items():
            out += [(role, url) for url in pool.urls]
            if pool.dns:
                out += [(role, url) for url in await resolve(pool.dns)]
        return out

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.sync()
            except OSError as e:  # DNS briefly unavailable: keep what we have
                log.warning("worker discovery failed (%s); keeping the current workers", e)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in list(self._draining):
            task.cancel()


async def resolve(dns: str) -> list[str]:
    """host:port -> every IPv4 address the host resolves to, as addr:port (sorted, no duplicates)."""
    host, _, port = dns.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dns {dns!r} must be name:port")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), family=socket.AF_INET,
                                                             type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []  # no ready pods right now: no workers from this name
    return sorted({f"{info[4][0]}:{port}" for info in infos})
