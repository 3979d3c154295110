"""The faults, one class each: `inject(harness)` hurts the deployment, returns when the fault is over
(a kill is over at once, a stop when the process is resumed), and returns what it measured.

    kill-prefill / kill-decode    SIGKILL of worker N's process group
    stop-prefill / stop-decode    SIGSTOP for stop_s, then SIGCONT (the supervisor may replace it first)
    cancel-storm                  `storm` streams whose clients walk away, half during prefill, half
                                  while decoding; measures how soon the pages in use are back to idle
    overload                      `capacity` requests at once (the normal load), then `bursts` bursts
                                  of `burst_factor` x capacity, one after another: refusals must be
                                  immediate 429s and the accepted requests as fast as under normal
                                  load (all sent as burst.py sends them: written at once on open
                                  connections); the slowest refusal is reported per burst too
    backlog                       `backlog` long prompts at once: a prefill queue far longer than any
                                  timer on the data path, with canaries and load going on
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import psutil

from clients.chaos.burst import in_own_process
from clients.chaos.client import health, page_gauges, pages_in_use

LONG_PROMPT = "Summarize the following records in one line. " + " ".join(
    f"Record {i}: the valve at site {i % 9} read {200 + i} kPa at {i % 24}:00." for i in range(60))


@dataclass(frozen=True)
class Kill:
    worker: str

    @property
    def name(self) -> str:
        return f"kill-{self.worker}"

    async def inject(self, h) -> dict:
        return {"pid": h.target.kill(self.worker), "requests_before": await routed(h, self.worker)}

    async def after(self, h, details: dict, since: float) -> None:
        """How soon the replacement is routed to again (its request counter moves past the kill's)."""
        deadline = since + 90.0
        while time.monotonic() < deadline:
            n = await routed(h, self.worker)
            if n is not None and n > (details["requests_before"] or 0):
                details["routed_again_s"] = time.monotonic() - since
                return
            await asyncio.sleep(0.25)
        details["routed_again_s"] = None


async def routed(h, worker: str) -> float | None:
    """Requests the orchestrator has sent to `worker`, from its /metrics."""
    try:
        async with h.session.get(f"{h.cfg.url}/metrics") as r:
            text = await r.text()
    except (OSError, asyncio.TimeoutError):
        return None
    tag = f'worker="{worker}"'
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("tandem_worker_requests_total{") and tag in line)


@dataclass(frozen=True)
class Stop:
    worker: str

    @property
    def name(self) -> str:
        return f"stop-{self.worker}"

    async def inject(self, h) -> dict:
        pid = h.target.stop(self.worker)
        t = time.monotonic()
        unhealthy = await _health_turns(h, False, t + h.cfg.stop_s)
        await asyncio.sleep(max(0.0, t + h.cfg.stop_s - time.monotonic()))
        h.target.resume(pid)
        resumed = time.monotonic()
        healthy = await _health_turns(h, True, resumed + 60.0)
        return {"pid": pid, "stopped_s": h.cfg.stop_s, "replaced_while_stopped": h.target.pid(self.worker) != pid,
                "health_503_after_s": None if unhealthy is None else unhealthy - t,
                "health_200_after_resume_s": None if healthy is None else max(0.0, healthy - resumed)}


async def _health_turns(h, want: bool, deadline: float) -> float | None:
    """When /health first says `want` (True: 200) before `deadline`, else None."""
    while time.monotonic() < deadline:
        if await health(h.session, h.cfg.url) == want:
            return time.monotonic()
        await asyncio.sleep(0.1)
    return None


@dataclass(frozen=True)
class CancelStorm:
    name: str = "cancel-storm"

    async def inject(self, h) -> dict:
        idle, held = await pages_in_use(h.session, h.cfg.url), h.background_pages()
        n = h.cfg.storm
        # half walk away while their long prompt is still in prefill, half a few tokens into the answer
        jobs = [h.request("storm", LONG_PROMPT, 64, cancel_after_s=0.2, exact_length=True) for _ in range(n // 2)]
        jobs += [h.request("storm", "Tell me a long story about a lighthouse keeper.", 200, cancel_after_s=2.0,
                           exact_length=True) for _ in range(n - n // 2)]
        outs = await asyncio.gather(*jobs)
        last_gone = max(o.end for o in outs)
        back, pages, allowed = await _pages_back(h, max(0.0, (idle or 0) - (held or 0)), last_gone)
        return {"streams": n, "pages_idle_before": idle, "pages_back_to_idle_s": back, "pages_then": pages,
                "background_pages_bound_then": allowed, "cancelled": sum(o.status == "CLIENT_CANCELLED" for o in outs),
                "pages_by_worker_then": None if back is not None else await page_gauges(h.session, h.cfg.url)}


async def _pages_back(h, idle: float, since: float, timeout_s: float = 30.0):
    """(seconds from `since`, pages in use, background bound) once the pages in use are back at `idle`
    (pages no request holds) plus what the load and canary requests in flight at that moment may hold:
    they run on, and the storm delayed them, so more of them are in flight after it than before. A
    deployment that does not publish its page size gets no allowance. Seconds are None if not in time."""
    deadline = since + timeout_s
    pages = held = None
    while time.monotonic() < deadline:
        pages, held = await pages_in_use(h.session, h.cfg.url), h.background_pages() or 0
        if pages is not None and pages <= idle + held:
            return max(0.0, time.monotonic() - since), pages, held
        await asyncio.sleep(0.05)
    return None, pages, held


@dataclass(frozen=True)
class Overload:
    name: str = "overload"

    async def inject(self, h) -> dict:
        cap = h.cfg.capacity
        proc = _orchestrator(h)
        rss0 = proc.memory_info().rss if proc else 0
        # both written at once on open connections, from a process of their own (burst.py): the clients'
        # own costs stay out of the times
        url, timeout = h.cfg.url, h.cfg.request_timeout_s
        normal = [h.record(o) for o in await in_own_process(url, "Name a color.", 8, cap, timeout)]
        floods = [[h.record(o) for o in await in_own_process(url, "Name a color.", 8, cap * h.cfg.burst_factor,
                                                             timeout)] for _ in range(h.cfg.bursts)]
        refused = [[o for o in flood if o.http == 429] for flood in floods]
        accepted = [o for flood in floods for o in flood if o.status == "OK"]
        every = [o.seconds for r in refused for o in r]
        rss1 = proc.memory_info().rss if proc else 0
        p50 = (lambda xs: statistics.median(xs) if xs else None)
        return {"capacity": cap, "burst": cap * h.cfg.burst_factor, "bursts": len(floods),
                "refused": len(every), "accepted": len(accepted), "refusal_s_p50": p50(every),
                "refusal_s_max": max(every, default=None),
                "refusal_s_max_per_burst": [round(max((o.seconds for o in r), default=0.0), 3) for r in refused],
                "normal_p50_s": p50([o.seconds for o in normal if o.status == "OK"]),
                "accepted_p50_s": p50([o.seconds for o in accepted]),
                "orchestrator_rss_growth_mb": (rss1 - rss0) / 1e6 if proc else None}


def _orchestrator(h):
    """The orchestrator process (the parent of the workers), to watch its memory."""
    try:
        return psutil.Process(h.target.pid(sorted(h.target.workers())[0])).parent()
    except (psutil.Error, OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Backlog:
    name: str = "backlog"

    async def inject(self, h) -> dict:
        t = time.monotonic()
        outs = await asyncio.gather(*[h.request("backlog", LONG_PROMPT, 8) for _ in range(h.cfg.backlog)])
        return {"prompts": len(outs), "completed": sum(o.status == "OK" for o in outs),
                "backlog_s": time.monotonic() - t}


def make(name: str):
    """A scenario by name: kill-<worker>, stop-<worker> (e.g. kill-decode-0), cancel-storm, overload, backlog."""
    for prefix, cls in (("kill-", Kill), ("stop-", Stop)):
        if name.startswith(prefix):
            return cls(name[len(prefix):])
    fixed = {"cancel-storm": CancelStorm, "overload": Overload, "backlog": Backlog}
    if name not in fixed:
        raise ValueError(f"unknown scenario {name!r}; allowed: kill-<worker>, stop-<worker>, {', '.join(fixed)}")
    return fixed[name]()

