"""One request through the OpenAI front door, as the harness sees it: its outcome, timed.

A request is greedy, streamed, and asks for exactly `max_tokens` tokens unless told otherwise; the
outcome records the HTTP status or the status of an error event on the stream, the text, and when
the first and last pieces arrived. `cancel_after_s` makes the client walk away mid-request.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from clients.sse_reader import sse_chunks


@dataclass
class Outcome:
    kind: str  # canary | load | storm | burst | backlog
    prompt: str
    start: float  # monotonic
    end: float = 0.0
    ttft: float | None = None
    status: str = ""  # OK, a tandem status name, CLIENT_CANCELLED, or TRANSPORT (connection failed)
    http: int = 0
    text: str = ""
    correct: bool | None = None  # set against the reference when there is one
    events: list[float] = field(default_factory=list, repr=False)

    @property
    def seconds(self) -> float:
        return self.end - self.start


async def complete(session: aiohttp.ClientSession, url: str, kind: str, prompt: str, max_tokens: int,
                   cancel_after_s: float | None = None, timeout_s: float = 120.0, exact_length: bool = False,
                   extra: dict | None = None) -> Outcome:
    """`exact_length`: ask for exactly max_tokens tokens (min_tokens too), so the answer cannot end early;
    `extra`: request fields over the greedy defaults (e.g. a seed, a temperature and a guide)."""
    out = Outcome(kind, prompt, time.monotonic())
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True} | (extra or {})
    if exact_length:
        body["min_tokens"] = max_tokens
    try:
        task = asyncio.ensure_future(_stream(session, url, body, out, timeout_s))
        if cancel_after_s is None:
            await task
        else:
            done, _ = await asyncio.wait({task}, timeout=cancel_after_s)
            if not done:
                task.cancel()  # closes the connection: the server sees the client go away
                out.status = "CLIENT_CANCELLED"
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
        out.status = out.status or f"TRANSPORT ({type(e).__name__})"
    out.end = time.monotonic()
    return out


async def _stream(session, url: str, body: dict, out: Outcome, timeout_s: float) -> None:
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"Tandem-Timeout": str(timeout_s)}) as resp:
        out.http = resp.status
        if resp.status != 200:
            out.status = error_code(await resp.read(), resp.status)
            return
        async for chunk in sse_chunks(resp):
            if not take_event(out, chunk):
                return
        out.status = "OK"


def take_event(out: Outcome, chunk: dict) -> bool:
    """Add one SSE event of a completion stream to `out`; False when it was an error event (the end)."""
    if "error" in chunk:
        out.status = chunk.get("status") or "ERROR"
        return False
    piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
    if piece:
        now = time.monotonic()
        out.ttft = out.ttft if out.ttft is not None else now - out.start
        out.events.append(now)
        out.text += piece
    return True


def error_code(raw: bytes | str, http: int) -> str:
    """The status an error body names (our {"error": {"code": ...}}), else HTTP_<status>."""
    try:
        return json.loads(raw)["error"]["code"] or f"HTTP_{http}"
    except (KeyError, TypeError, ValueError):
        return f"HTTP_{http}"


async def health(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def pages_in_use(session: aiohttp.ClientSession, url: str) -> float | None:
    """KV pages in use, summed over workers, as the front door's /metrics reports them."""
    return await _metric_sum(session, url, "tandem_kv_pages_used{")


async def tokens_per_page(session: aiohttp.ClientSession, url: str) -> int | None:
    """The deployment's KV page size (its /metrics), None if it does not say."""
    n = await _metric_sum(session, url, "tandem_kv_tokens_per_page ")
    return int(n) if n else None


async def page_gauges(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every worker's page gauges (used, held for a reader, cached) by series: where pages stayed."""
    text = await _metrics(session, url) or ""
    names = ("tandem_kv_pages_used{", "tandem_kv_pages_held{", "tandem_prefix_cache_pages{")
    return {line.rsplit(" ", 1)[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith(names)}


async def _metric_sum(session: aiohttp.ClientSession, url: str, prefix: str) -> float | None:
    text = await _metrics(session, url)
    if text is None:
        return None
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


async def _metrics(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def pages_bound(prompt: str, max_tokens: int, tokens_per_page: int) -> int:
    """At most the pages one request holds over all workers: its whole context on the decode worker,
    its prompt on the prefill worker while prefilling. A byte-level tokenizer makes at most one token
    per byte of the prompt (plus a begin-of-text token)."""
    tokens = len(prompt.encode()) + 1
    return -(-(tokens + max_tokens) // tokens_per_page) + -(-tokens // tokens_per_page)
