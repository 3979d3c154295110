"""The LoRA adapters a request may name, and every worker kept holding them while the server runs.

An adapter has a name (what a request's `model`, or a Triton client's `lora_name`, says) and a key (what
SamplingParams.lora carries to the workers, and what its prefix-cache chain is salted with:
tandem/prefix.tenant_salt). One given at start (--lora-modules) is keyed by its name; one loaded while
serving (POST /v1/load_lora_adapter) by its name and a random suffix, so an adapter loaded again under a
name never meets pages its predecessor cached, on any worker, whether or not this server restarted.

    load    the adapter goes to every routable worker (`Adapters`: the set this orchestrator needs,
            tandem/wire.py); it is nameable once every one holds it. One refusing: the others are sent the
            set without it again and the load fails with that worker's status.
    unload  not nameable from then on; its key stays on the workers while a request that named it is
            still being served (`hold`, for the request's whole life, retries included), then every
            worker is sent the set without it. Loading a name again in place is both at once.
    join    a worker that joins (started, restarted, back after a stall) is sent the set before it is
            routed to (the fleet's on_join); until then it holds only the adapters it was started with.
    release at this orchestrator's stop every worker is sent an empty set: what it held for this
            orchestrator alone leaves it (a replica scaled down leaves nothing behind). One killed
            without stopping: a worker drops its set when its watch has been gone a while
            (engine/workers/adapter_set.py); were it alive after all, it sends the set on rejoining.

Every send is made under one lock, so a worker applies the sets in the order they were decided. The
sets carry this orchestrator's own random id (Fleet.owner, which its watches carry too): orchestrators
sharing workers (replicas behind one Service) each keep their own list, loaded on each, and a worker
holds what any of them needs (engine/workers/adapter_set.py). Adapters given at start stay on the
workers (their configuration) even when unloaded here: unloading one only stops requests naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass

from control.fleet import Fleet, WorkerState
from tandem.status import InvalidArgument, NotFound, ResourceExhausted, TandemError

log = logging.getLogger("tandem.adapters")


@dataclass
class _Adapter:
    name: str
    key: str
    folder: str
    holds: int = 0  # requests being served with it
    retired: bool = False  # unloaded: dropped from the workers once `holds` is 0


class Adapters:
    """The served adapters, by name; iterating gives the nameable names in the order they came."""

    def __init__(self, modules: dict[str, str] | None = None, max_adapters: int = 16):
        """`modules`: folder by name, given at start (the workers were started holding them)."""
        self.max_adapters = max_adapters
        self._by_key = {name: _Adapter(name, name, folder) for name, folder in (modules or {}).items()}
        self._names = {name: name for name in self._by_key}  # nameable name -> its key
        self._changed = False  # whether the set differs from the one the workers were started with
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.fleet: Fleet | None = None  # set by `attach`

    def attach(self, fleet: Fleet) -> None:
        """Keep `fleet`'s workers holding the set: each joining worker is sent it first (Fleet.on_join)."""
        self.fleet = fleet
        fleet.on_join = self.join

    # -- what requests see --------------------------------------------------------------------------

    def __contains__(self, name) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(list(self._names))

    def key_of(self, name: str | None) -> str:
        """The key requests for `name` carry; "" when it names no adapter (the base model)."""
        return self._names.get(name, "") if isinstance(name, str) else ""

    @contextlib.contextmanager
    def hold(self, key: str):
        """Hold adapter `key` ("": none) on the workers while a request is served; NotFound when it was
        unloaded after the request named it."""
        if not key:
            yield
            return
        a = self._by_key.get(key)
        if a is None or a.retired:  # unloaded between the request's preparation and now
            name = key.partition("#")[0]  # a key is its adapter's name, then a load's suffix
            raise NotFound(f"LoRA adapter {name!r} was unloaded; send the request again to see what is served now",
                           "model")
        a.holds += 1
        try:
            yield
        finally:
            a.holds -= 1
            if a.retired and not a.holds:
                self._drop(a)

    # -- changes (the HTTP routes: frontdoor/http_lora.py) --------------------------------------------

    async def load(self, name: str, folder: str, replace: bool = False) -> None:
        """Make adapter `name` (checked already: frontdoor/http_lora.py) from `folder` nameable once every
        routable worker holds it; `replace`: in place of one of that name. Nothing changes on failure."""
        async with self._lock:
            if name in self._names and not replace:
                raise InvalidArgument(f"LoRA adapter {name!r} is already loaded; unload it first, or send "
                                      f"load_inplace: true to replace it", "lora_name")
            # the one a load in place replaces counts as gone, so a replacement fits at the limit (one over
            # at most, while the old one finishes its requests)
            held = len(self._by_key) - (replace and name in self._names)
            if held >= self.max_adapters:
                raise ResourceExhausted(f"the server holds {held} LoRA adapters, its most "
                                        f"(lora_loading.max_adapters, unloaded ones counted until their last "
                                        f"request ends); unload one first")
            new = _Adapter(name, f"{name}#{secrets.token_hex(4)}", folder)
            self._by_key[new.key] = new
            self._changed = True
            try:
                await self._send_all()
            except TandemError as e:
                del self._by_key[new.key]
                with contextlib.suppress(TandemError):  # those that took it let it go; a worker that
                    await self._send_all()  # cannot be reached is sent the set when it joins again
                raise type(e)(str(e).replace(new.key, name), "lora_path") from None
            old = self._names.get(name)
            self._names[name] = new.key
            if old is not None:
                self._retire(old)
        log.info("LoRA adapter %s loaded from %s%s", name, folder, " in place" if old else "")

    async def unload(self, name: str) -> None:
        """No request may name `name` from now on; the workers drop it after the last one naming it."""
        async with self._lock:
            key = self._names.pop(name, None) if isinstance(name, str) else None
            if key is None:
                raise NotFound(f"LoRA adapter {name!r:.140} is not loaded; loaded: {list(self._names) or 'none'}",
                               "lora_name")
            self._retire(key)
        log.info("LoRA adapter %s unloaded", name)

    def _retire(self, key: str) -> None:
        a = self._by_key[key]
        a.retired = True
        if not a.holds:
            self._drop(a)

    def _drop(self, a: _Adapter) -> None:
        if self._by_key.pop(a.key, None) is None:  # released already (this orchestrator stopped)
            return
        self._changed = True
        task = asyncio.get_running_loop().create_task(self._send_later(), name="adapters-drop")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_later(self) -> None:
        async with self._lock:
            try:
                await self._send_all()
            except TandemError as e:  # it holds one adapter too many until it is sent the set again
                log.warning("a worker did not drop an unloaded LoRA adapter: %s", e)

    # -- the workers ----------------------------------------------------------------------------------

    def modules(self) -> dict[str, str]:
        """What every worker should hold: folder by key (adapters retired but still serving included)."""
        return {a.key: a.folder for a in self._by_key.values()}

    async def _send_all(self) -> None:
        """Send the set to every routable worker; the first failure's TandemError, naming its worker (the
        others still get the set)."""
        workers = [w for w in self.fleet.workers.values() if w.routable] if self.fleet is not None else []
        modules = self.modules()
        results = await asyncio.gather(*(w.client.set_adapters(self.fleet.owner, modules) for w in workers),
                                       return_exceptions=True)
        for w, r in zip(workers, results):
            if isinstance(r, BaseException):
                if not isinstance(r, TandemError):
                    raise r
                raise type(r)(f"worker {w.name}: {r}")

    async def release(self, timeout_s: float = 5.0) -> None:
        """At this orchestrator's stop, after its last request: every routable worker is sent an empty set
        (its own configured adapters stay). A worker not answering within `timeout_s` keeps the set until
        it sees this orchestrator's watch gone (engine/workers/adapter_set.py: OWNER_GRACE_S)."""
        if not self._changed or self.fleet is None:  # the workers were never sent a set by this orchestrator
            return
        for task in self._tasks:  # drops still to be sent: the empty set supersedes them
            task.cancel()
        async with self._lock:
            self._by_key.clear()
            self._names.clear()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._send_all()
            except (TandemError, TimeoutError) as e:
                log.warning("a worker keeps this server's LoRA adapters until it sees this server gone: %s",
                            e or "no answer")

    async def join(self, w: WorkerState) -> None:
        """Before `w` is routed to: send it the set, when it may differ from what it was started with."""
        if not self._changed:
            return
        async with self._lock:
            try:
                await w.client.set_adapters(self.fleet.owner, self.modules())
            except TandemError as e:
                log.warning("worker %s cannot take the LoRA adapters %s: %s", w.name, list(self._names), e)
                raise
