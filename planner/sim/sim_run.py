"""Simulate one workload on one layout: build the workers, feed the arrivals, run the clock.

Open-loop requests arrive at their drawn times. Closed-loop clients send their first requests at
time 0 and each next one when the client has received the last token of its previous answer
(engine time plus the front door's overhead), until the workload's request count is used up. Both
may run at once: beside the clients, requests with an arrival time arrive then (a benchmark's
open stream next to its closed-loop one, replayed).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.costs import PassCosts
from planner.profile import Profile
from planner.served import overhead
from planner.sim.colocated import ColocatedSim
from planner.sim.disaggregated import Disaggregated, pool_pages
from planner.sim.events import EventLoop
from planner.sim.sim_layouts import Layout, speedup
from planner.sim.pages import PagePool
from planner.sim.replicas import Replicas
from planner.sim.request import SimRequest
from planner.plan_workload import RequestSpec


@dataclass
class SimRun:
    layout: Layout
    requests: list[SimRequest]  # in workload order
    pools: list[PagePool]  # every KV pool of the layout (traces when asked for)
    system: object  # the Disaggregated or Replicas object, for inspection


def build_system(profile: Profile, layout: Layout, loop: EventLoop, on_done, *, chunk_tokens: int | None = None,
                 trace_pages: bool = False):
    """The simulated workers of `layout`. `chunk_tokens` overrides the profile's (chunked layouts)."""
    if layout.kind == "disaggregated":
        decode = PassCosts.of(profile, served=overhead(profile.served, "decode", 1))
        return Disaggregated(loop, profile, PassCosts.of(profile), decode, layout.workers, layout.decode_workers,
                             on_done, trace_pages)
    n = layout.devices_per_worker
    sp, sd = speedup(profile, "prefill", n), speedup(profile, "decode", n)
    if sp is None or sd is None:
        raise ValueError(f"layout {layout.name}: the profile gives no speedup for {n} devices")
    s = profile.serving
    chunk = (chunk_tokens or s.chunk_tokens) if layout.kind == "chunked" else None
    costs = PassCosts.of(profile, sp, sd, overhead(profile.served, "colocated", n))
    replicas = Replicas(loop, [], on_done)
    replicas.engines += [ColocatedSim(loop, costs, PagePool(pool_pages(profile, n), s.tokens_per_page, trace_pages),
                                      pass_tokens=s.pass_tokens, max_batch=s.colocated_max_batch, chunk_tokens=chunk,
                                      on_done=replicas.finished) for _ in range(layout.workers)]
    return replicas


def simulate(profile: Profile, layout: Layout, specs: list[RequestSpec], *, concurrency: int | None = None,
             chunk_tokens: int | None = None, trace_pages: bool = False) -> SimRun:
    """Run every request of `specs` through `layout`. `concurrency`: that many closed-loop clients send
    the specs without an arrival time, in order; every other spec arrives at its time (without
    `concurrency`, every spec needs one)."""
    loop = EventLoop()
    reqs = [SimRequest(i, s.prompt_len, s.output_len, priority=s.priority) for i, s in enumerate(specs)]
    if concurrency is None and any(s.arrival is None for s in specs):
        raise ValueError("open-loop simulation needs an arrival time for every request")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    clients = [r for r, s in zip(reqs, specs) if s.arrival is None]  # the closed loop's, in order
    front = profile.frontdoor
    sent = min(concurrency or 0, len(clients))

    def submit(req: SimRequest) -> None:
        req.arrival = loop.now
        system.submit(req)

    def on_done(req: SimRequest) -> None:
        nonlocal sent
        if specs[req.index].arrival is not None or sent >= len(clients):
            return  # an open-loop request, or the clients have sent everything
        end = loop.now if req.failed else req.done_at + front.ttft_s + (req.answer_len - 1) * front.per_token_s
        loop.at(max(end, loop.now), submit, clients[sent])
        sent += 1

    system = build_system(profile, layout, loop, on_done, chunk_tokens=chunk_tokens, trace_pages=trace_pages)
    for req, spec in zip(reqs, specs):
        if spec.arrival is not None:
            loop.at(spec.arrival, submit, req)
    for req in clients[:sent]:
        loop.at(0.0, submit, req)
    loop.run()
    unfinished = [r.index for r in reqs if not r.finished and r.failed is None]
    if unfinished:
        raise RuntimeError(f"simulator bug: requests {unfinished[:5]} never finished on {layout.name}")
    return SimRun(layout, reqs, system.pools, system)
