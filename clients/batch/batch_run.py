"""One batch run against a tandem serve's HTTP door (batch_file.py has the file formats).

At most `concurrency` requests are in flight. The server's "not now" (429 or 503: admission full,
pages short, a drain) and a request that got no answer (no connection, the connection lost, the
timeout) are asked again, up to `retries` times, after the server's Retry-After or a growing pause
(0.5 s doubling to 10 s, jittered so that refused workers do not return together). Each result is
written as one line and flushed as soon as it came, so an interrupted run leaves whole results behind
and `--resume` asks only for the rest.
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from clients.batch.batch_file import RETRIED, BatchRequest, failure, is_final, result

MAX_PAUSE_S = 10.0
MAX_RETRY_AFTER_S = 30.0


@dataclass
class Tally:
    """What a run did: results by HTTP status ("none": no answer), tokens, and its time."""

    total: int = 0  # requests this run asks
    statuses: Counter = field(default_factory=Counter)
    not_final: int = 0  # results that --resume asks again (still refused as busy, or unanswered)
    asked_again: int = 0  # requests sent again after a 429, a 503 or no answer
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def add(self, line: dict) -> None:
        response = line["response"]
        self.statuses[str(response["status_code"]) if response else "none"] += 1
        self.not_final += not is_final(line)
        usage = (response or {}).get("body") or {}
        usage = usage.get("usage") if isinstance(usage, dict) else None
        if isinstance(usage, dict):  # chat and completions name them so; the Responses API input/output
            self.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
            self.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0

    @property
    def done(self) -> int:
        return sum(self.statuses.values())

    def summary(self) -> str:
        statuses = ", ".join(f"{n} × {s}" for s, n in sorted(self.statuses.items()))
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (f"{self.done} of {self.total} requests answered in {self.seconds:.1f} s ({statuses or 'none'}; "
                f"asked again {self.asked_again} times); "
                f"{self.prompt_tokens} prompt and {self.completion_tokens} completion tokens, {rate:.1f} completion "
                f"tokens/s")


async def run_batch(requests: Iterable[BatchRequest], total: int, url: str, out_path: str, *, concurrency: int,
                    retries: int, timeout_s: float, api_key: str | None = None, ssl_context: ssl.SSLContext | None = None,
                    log: Callable[[str], None] = print, every_s: float = 10.0) -> Tally:
    """Ask every request of `requests` (`total` of them) at `url` (a serve's HTTP door) and append each
    result to `out_path`; the tally once all are written. A progress line goes to `log` every `every_s`."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    tally, pending, start = Tally(total=total), iter(requests), time.monotonic()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    with open(out_path, "a", encoding="utf-8") as out:
        async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=concurrency, ssl=ssl_context)) as s:
            async def worker() -> None:
                for req in pending:  # one iterator shared by all workers: each request is taken once
                    line, again = await _ask(s, url.rstrip("/") + req.url, req, retries)
                    tally.asked_again += again
                    out.write(json.dumps(line) + "\n")
                    out.flush()
                    tally.add(line)

            async def progress() -> None:
                while True:
                    await asyncio.sleep(every_s)
                    log(f"{tally.done}/{total} done, {tally.not_final} to ask again, {time.monotonic() - start:.0f} s")

            reporter = asyncio.create_task(progress())
            try:
                await asyncio.gather(*(worker() for _ in range(min(concurrency, total) or 1)))
            finally:
                reporter.cancel()
    tally.seconds = time.monotonic() - start
    return tally


async def _ask(session: aiohttp.ClientSession, url: str, req: BatchRequest, retries: int) -> tuple[dict, int]:
    """The result line of one request, asked again while the server says "not now" or does not answer, and
    how many times it was asked again."""
    attempt = 0
    while True:
        try:
            async with session.post(url, json=req.body) as r:
                body = await _body(r)
                if r.status not in RETRIED or attempt == retries:
                    return result(req.custom_id, r.status, r.headers.get("X-Request-Id", ""), body), attempt
                pause = _retry_after(r.headers.get("Retry-After")) or _pause(attempt)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            if attempt == retries:
                return failure(req.custom_id, "no_answer", f"{type(e).__name__}: {e}".strip(": ")), attempt
            pause = _pause(attempt)
        await asyncio.sleep(pause)
        attempt += 1


async def _body(r: aiohttp.ClientResponse):
    """The answer's JSON body; a body that is not JSON (a proxy's page) as an error object with its text."""
    text = await r.text(errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"error": {"message": text[:2000], "type": "not_json"}}


def _retry_after(value: str | None) -> float | None:
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER_S) if value else None
    except ValueError:  # an HTTP date: not sent by tandem, paused as if absent
        return None


def _pause(attempt: int) -> float:
    return min(0.5 * 2 ** attempt, MAX_PAUSE_S) * random.uniform(0.5, 1.0)
