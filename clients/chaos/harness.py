"""The harness: references, background load and canaries, and the faults one after another.

While the harness runs, `load_clients` closed-loop clients send greedy requests and a canary request
leaves every `canary_interval_s`; every completed greedy answer is compared with its reference (the
same prompt answered by a single in-process engine, or by the healthy server at the start). A fault
scenario (scenarios.py) injects its fault and reports when the fault ended; the harness then waits for
recovery: /health 200 and a canary sent after the fault that comes back exact.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from clients.chaos.client import Outcome, complete, health, pages_bound, pages_in_use, tokens_per_page
from clients.chaos.faults import LocalTarget

log = logging.getLogger("tandem.chaos")

CANARIES = ("The capital of France is", "Water boils at a temperature of", "The first month of the year is",
            "A triangle has three")
LOAD = ("Write a short note about the weather today.", "List three uses of copper.",
        "Explain in one sentence what a compiler does.", "Describe a sunrise over the sea.", "Describe a city as JSON.")
# prompts sent with more than the greedy defaults, checked as exactly: a seeded, sampled answer that
# follows a JSON schema (structured output), so a resumed one must rebuild its grammar state and draws
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "founded": {"type": "integer", "minimum": 0, "maximum": 2100}},
        "required": ["city", "founded"], "additionalProperties": False}
EXTRA = {"Describe a city as JSON.": {"temperature": 0.8, "seed": 7, "guided_json": CITY}}


@dataclass(frozen=True)
class ChaosConfig:
    url: str  # the front door's HTTP address
    workdir: str  # the `tandem serve` workdir (its workers.json says which pid is which worker)
    load_clients: int = 3
    canary_interval_s: float = 1.0
    canary_tokens: int = 12
    load_tokens: int = 24
    settle_s: float = 3.0  # quiet time before each fault, and after the last one
    recover_timeout_s: float = 90.0
    stop_s: float = 20.0  # SIGSTOP length
    storm: int = 100  # streams in the cancel storm
    burst_factor: int = 10  # the overload burst, in multiples of the admission limit
    bursts: int = 3  # overload bursts, one after another (the slowest refusal varies from one to the next)
    capacity: int = 32  # the deployment's limits.max_in_flight
    backlog: int = 6  # long prompts in the backlog scenario
    request_timeout_s: float = 120.0


@dataclass
class Window:
    name: str
    start: float
    fault_end: float = 0.0
    recovered_at: float | None = None
    details: dict = field(default_factory=dict)


class Harness:
    def __init__(self, cfg: ChaosConfig, references: dict[str, str]):
        self.cfg = cfg
        self.references = references  # prompt -> exact greedy text at its max_tokens
        self.target = LocalTarget(cfg.workdir)
        self.outcomes: list[Outcome] = []
        self.windows: list[Window] = []
        self._stop = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None  # canaries, load, metrics
        self.crowd: aiohttp.ClientSession | None = None  # storms, bursts, backlogs
        self.background: dict[object, tuple[str, int]] = {}  # canary and load requests in flight: (prompt, max_tokens)
        self.tokens_per_page: int | None = None

    def record(self, out: Outcome) -> Outcome:
        ref = self.references.get(out.prompt)
        if out.status == "OK" and ref is not None:
            out.correct = out.text == ref
        self.outcomes.append(out)
        return out

    async def request(self, kind: str, prompt: str, max_tokens: int, cancel_after_s: float | None = None,
                      exact_length: bool = False) -> Outcome:
        # storms and bursts open a connection each (no pool, no limit): a client that goes away closes
        # its connection, and a burst is not queued on our side before it reaches the server
        background = kind in ("canary", "load")
        session = self.session if background else self.crowd
        key = object()  # kept alive until the request ends (an id() could be reused at once)
        if background:
            self.background[key] = (prompt, max_tokens)
        try:
            return self.record(await complete(session, self.cfg.url, kind, prompt, max_tokens, cancel_after_s,
                                              self.cfg.request_timeout_s, exact_length, EXTRA.get(prompt)))
        finally:
            self.background.pop(key, None)

    def background_pages(self) -> int | None:
        """At most the pages the canary and load requests in flight hold now (None: page size unknown)."""
        if not self.tokens_per_page:
            return None
        return sum(pages_bound(p, n, self.tokens_per_page) for p, n in self.background.values())

    async def _load(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            out = await self.request("load", LOAD[(i + n) % len(LOAD)], self.cfg.load_tokens)
            n += 1
            if out.status != "OK":
                await asyncio.sleep(0.2)  # a refused or failed request: do not spin on a sick server

    async def _canaries(self) -> None:
        n = 0
        tasks = set()
        while not self._stop.is_set():
            t = asyncio.ensure_future(self.request("canary", CANARIES[n % len(CANARIES)], self.cfg.canary_tokens))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            n += 1
            try:
                await asyncio.wait_for(self._stop.wait(), self.cfg.canary_interval_s)
            except asyncio.TimeoutError:
                pass  # the next canary is due
        await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self, scenarios: list) -> dict:
        from clients.chaos.chaos_report import summarize

        crowd = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session, \
                aiohttp.ClientSession(connector=crowd, timeout=aiohttp.ClientTimeout(total=None)) as self.crowd:
            self.session = session
            self.tokens_per_page = await tokens_per_page(session, self.cfg.url)
            t0 = time.monotonic()
            background = [asyncio.ensure_future(self._load(i)) for i in range(self.cfg.load_clients)]
            background.append(asyncio.ensure_future(self._canaries()))
            try:
                for scenario in scenarios:
                    await asyncio.sleep(self.cfg.settle_s)
                    await self._run_one(scenario)
                await asyncio.sleep(self.cfg.settle_s)
            finally:
                self._stop.set()
                await asyncio.gather(*background, return_exceptions=True)
            idle_pages = await self._idle_pages()
        return summarize(self, t0, idle_pages)

    async def _run_one(self, scenario) -> None:
        w = Window(scenario.name, time.monotonic())
        self.windows.append(w)
        log.info("fault %s", scenario.name)
        w.details = await scenario.inject(self) or {}
        w.fault_end = time.monotonic()
        w.recovered_at = await self._recovered(w.fault_end)
        if hasattr(scenario, "after"):
            await scenario.after(self, w.details, w.start)
        log.info("fault %s: %s", scenario.name, "recovered" if w.recovered_at else "did NOT recover")

    async def _recovered(self, since: float) -> float | None:
        """When a canary sent after `since` came back exact with /health 200 (None: not in time)."""
        deadline = since + self.cfg.recover_timeout_s
        while time.monotonic() < deadline:
            good = [o for o in self.outcomes if o.kind == "canary" and o.start >= since and o.correct]
            if good and await health(self.session, self.cfg.url):
                return min(o.end for o in good)
            await asyncio.sleep(0.25)
        return None

    async def _idle_pages(self) -> float | None:
        """Pages in use once everything is done (should be 0): give the last releases a moment."""
        deadline = time.monotonic() + 10
        pages = await pages_in_use(self.session, self.cfg.url)
        while pages and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            pages = await pages_in_use(self.session, self.cfg.url)
        return pages


async def server_references(url: str, max_tokens: dict[str, int]) -> dict[str, str]:
    """Each prompt's answer (greedy, or as EXTRA says) from the healthy server, one at a time."""
    out = {}
    async with aiohttp.ClientSession() as session:
        for prompt, n in max_tokens.items():
            o = await complete(session, url, "reference", prompt, n, extra=EXTRA.get(prompt))
            if o.status != "OK":
                raise RuntimeError(f"the server could not answer the reference prompt {prompt!r}: {o.status}")
            out[prompt] = o.text
    return out
