"""The disaggregated system: x prefill workers, y decode workers, and the orchestrator's routing.

A request's life: a decode worker with free pages for prompt + max_tokens reserves them (when none
has them the request waits in the orchestrator and retries after pages are freed: waiting.py); a
prefill worker takes its prompt; when its first token and K/V are ready (pass end plus the handoff's
tail) it joins that decode worker's batch.
Routing is least-loaded, by the router's own rules (policies/routing.py): the decode worker with
room that holds the fewest requests (then the most free pages), and the prefill worker with the
fewest prompt tokens queued or in flight.
A request refused for pages preempts one holding pages of a worse priority (waiting.py), on the decode
worker that refused it (the one with the most free pages) first: its prefill dropped, or its place in the
decode batch; it waits and resumes.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.costs import PassCosts
from planner.profile import Profile
from planner.sim.sim_decode import DecodeSim
from planner.sim.events import EventLoop
from planner.sim.pages import PagePool
from planner.sim.sim_prefill import Link, PrefillSim
from planner.sim.request import SimRequest
from planner.sim.waiting import FleetWait, Holders
from policies.routing import least_loaded_decode, least_queued_prefill, most_free


def pool_pages(profile: Profile, devices: int = 1) -> int:
    """Pages in the KV pool of one engine on `devices` devices (the profile gives bytes per device)."""
    s = profile.serving
    return max(1, devices * s.kv_pool_bytes // (profile.model.kv_bytes_per_token * s.tokens_per_page))


class Disaggregated:
    def __init__(self, loop: EventLoop, profile: Profile, prefill_costs: PassCosts, decode_costs: PassCosts,
                 prefill_workers: int, decode_workers: int, on_done: Callable[[SimRequest], None],
                 trace_pages: bool = False):
        s = profile.serving
        self.loop = loop
        self.on_done = on_done
        self.decode = [DecodeSim(loop, decode_costs, PagePool(pool_pages(profile), s.tokens_per_page, trace_pages),
                                 max_batch=s.decode_max_batch, on_done=self._done) for _ in range(decode_workers)]
        self.prefill = [PrefillSim(loop, prefill_costs, Link(profile.handoff.gbytes_per_s, profile.handoff.latency_s),
                                   pass_tokens=s.pass_tokens, tokens_per_page=s.tokens_per_page,
                                   kv_bytes_per_token=profile.model.kv_bytes_per_token, on_ready=self._ready)
                        for _ in range(prefill_workers)]
        self.wait = FleetWait(loop, self._try_open, self._make_room)
        self.holders = Holders()  # requests with pages reserved, and on which decode worker
        self.preemptions = 0

    @property
    def pools(self) -> list[PagePool]:
        return [d.pool for d in self.decode]

    def submit(self, req: SimRequest) -> None:
        pool = self.decode[0].pool
        if pool.pages_for(req.budget) > pool.num_pages:
            req.failed = (f"needs {pool.pages_for(req.budget)} KV pages; a decode worker's whole pool has "
                          f"{pool.num_pages}")
            self.on_done(req)
            return
        self.wait.submit(req)

    def _try_open(self, req: SimRequest) -> bool:
        """Reserve pages on the least-loaded decode worker that has them and queue the prompt on the
        prefill worker with the fewest prompt tokens; False when no decode worker has the pages."""
        d = least_loaded_decode(self.decode, fits=lambda d: d.can_reserve(req), running=lambda d: d.holding,
                                pages_free=lambda d: d.pool.pages_free)
        if d is None:
            return False
        d.reserve(req)
        self.holders.add(req, d)
        least_queued_prefill(self.prefill, lambda p: p.load_tokens).submit(req)
        return True

    def _make_room(self, priority: int) -> bool:
        """Preempt the holder of pages `least_urgent` names: its prefill dropped (if under way), its
        pages freed; it waits and resumes. False if none is worse."""
        refused_by = most_free(self.decode, lambda d: d.pool.pages_free)  # whom the router asks when none has room
        victim = self.holders.least_urgent(priority, refused_by)
        if victim is None:
            return False
        d = self.holders.pop(victim)
        any(p.drop(victim) for p in self.prefill)
        victim.preempted(d.drop(victim))
        self.preemptions += 1
        self.wait.requeue(victim)
        return True

    def _ready(self, req: SimRequest) -> None:
        req.first_token = self.loop.now
        self.holders.worker(req).arrive(req)

    def _done(self, req: SimRequest) -> None:
        self.holders.pop(req)
        self.on_done(req)
        self.wait.pages_freed()
