"""A worker's exported KV pool as its peers see it: the transports that reach it, lease slots and the
fence. A decode worker's pool, written by prefill workers (push); a prefill worker's pool, read by
decode workers (pull: the slots fence its holds, engine/workers/holds.py).

The pool is one KVCache (in shared memory when shm is offered, in GPU memory for cuda_ipc). `PoolHost`
publishes one descriptor naming every transport, picks the transport for each lease or hold from where
its peer runs (shm or cuda_ipc on the same host, NIXL otherwise, unless the deployment forces one), and
hands out fence slots: a slot is armed when a destination or source is handed out and free again only
after its peer is fenced out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engine.kv_pool import KVCache
from engine.transports import PoolEndpoint, endpoint
from engine.transports.base import Notices
from engine.transports.fence import FenceTable
from tandem.pool import Destination, PoolDescriptor, host_identity
from tandem.status import OutOfPages, TransferFailed


class PoolHost:
    def __init__(self, cache: KVCache, transports: tuple[str, ...], registry: dict | None = None):
        if not transports:
            raise ValueError("a pool needs at least one transport")
        self.cache = cache
        self.fence = FenceTable(cache.num_pages)  # a lease holds >= 1 page: never more leases than pages
        self.endpoints: dict[str, PoolEndpoint] = {}
        try:
            for name in transports:
                self.endpoints[name] = endpoint(name, cache, self.fence.name, registry)
        except BaseException:
            self.close()
            raise
        self.host = host_identity()
        self._slots = deque(range(cache.num_pages))
        parts = {name: ep.part() for name, ep in self.endpoints.items()}
        self.descriptor = PoolDescriptor(layout=cache.layout, num_pages=cache.num_pages, num_slots=cache.num_pages,
                                         host=self.host, **parts)

    def choose(self, peer_host: str) -> str:
        """The transport a peer (writer or reader) on `peer_host` uses: the one-host one (shm, cuda_ipc;
        inproc in tests) when it shares this pool's host identity, else NIXL."""
        local = peer_host == self.host
        for name in ("inproc", "shm", "cuda_ipc") if local else ():
            if name in self.endpoints:
                return name
        if "nixl" in self.endpoints:
            return "nixl"
        raise TransferFailed(f"the other worker runs on another host and this pool offers only "
                             f"{sorted(self.endpoints)}; deploy with transport nixl (or auto) for remote workers")

    def lease_slot(self) -> tuple[int, int]:
        """A free fence slot and the epoch armed in it."""
        if not self._slots:
            raise OutOfPages(1, 0)  # every slot fenced or leased: the pool has no room either
        slot = self._slots.popleft()
        return slot, self.fence.arm(slot)

    def destination(self, transport: str, page_ids: list[int], slot: int, epoch: int, start: int = 0) -> Destination:
        return Destination(transport=transport, pool=self.descriptor, page_ids=list(page_ids), slot=slot,
                           epoch=epoch, start=start)

    def needs_progress(self, transport: str) -> bool:
        return self.endpoints[transport].needs_progress()

    def strict(self, transport: str) -> bool:
        return self.endpoints[transport].strict_fence

    def revoke(self, slot: int, on_done: Callable[[int], None]) -> bool:
        """Fence the slot's writer out (see fence.py); True if done now, else `on_done(slot)` later."""
        return self.fence.revoke(slot, on_done)

    def free_slot(self, slot: int) -> None:
        self._slots.append(slot)

    def poll(self) -> Notices:
        out = Notices()
        for ep in self.endpoints.values():
            n = ep.poll()
            out.ready |= n.ready
            out.closed |= n.closed
        return out

    @property
    def notifies(self) -> set[str]:
        return {name for name, ep in self.endpoints.items() if ep.notifies}

    def close(self) -> None:
        for ep in self.endpoints.values():
            ep.close()
        self.fence.close()
