"""A preemption storm on a real 1P2D stack (`--scheduling-policy priority`, 16-page decode pools, push
and pull handoffs): 24 requests of four priorities, sampled at temperature 1 with seeds, arrive over a
few seconds, and some walk away mid-stream. Each needs up to 14 pages, so the pools hold two or three
at a time and urgent ones keep preempting less urgent ones. Every answer that finishes is exactly its
answer alone (a preempted request resumes exactly), none fails, every page comes back, and each
preemption frees pages for the request that caused it. Before e838c02 and the attempt ids of its
successor, a pull storm preempted 73 times for 24 requests (a request counted as placed at its first
token, the prefill worker's, before its decode worker leased anything), and a push storm answered one
request 400 "already open here" (a retry after a preemption reused the id of the attempt still open)."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from clients.sse_reader import sse_chunks
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import metric_total, pages_used

PAGE = 16 * 46080  # the default model's KV bytes per 16-token page
REQUESTS = 24


def _bodies() -> list[dict]:
    rnd = random.Random(11)
    return [{"prompt": f"Request {i}: tell me about topic {rnd.randint(0, 99)}.", "stream": True, "ignore_eos": True,
             "max_tokens": rnd.choice((20, 60, 120, 200)), "temperature": 1.0, "seed": i,
             "priority": rnd.choice((-5, 0, 5, 9))} for i in range(REQUESTS)]


async def _send(session: aiohttp.ClientSession, url: str, body: dict, cancel_after_s: float | None = None) -> tuple:
    """("OK", text), ("HTTP", status, body), ("ERROR", event), or ("CANCELLED",) when the client walked away."""
    async def run() -> tuple:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return "HTTP", r.status, await r.text()
            text = ""
            async for chunk in sse_chunks(r):
                if "error" in chunk:
                    return "ERROR", chunk
                text += chunk["choices"][0]["text"] if chunk.get("choices") else ""
            return "OK", text
    task = asyncio.ensure_future(run())
    done, _ = await asyncio.wait({task}, timeout=cancel_after_s)
    if done:
        return task.result()
    task.cancel()  # closes the connection: the server sees the client go away
    return ("CANCELLED",)


async def _storm(url: str, bodies: list[dict]) -> list[tuple]:
    rnd = random.Random(5)
    plan = [(rnd.uniform(0, 6), rnd.uniform(0.5, 4) if rnd.random() < 0.2 else None) for _ in bodies]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def later(body: dict, delay: float, cancel: float | None) -> tuple:
            await asyncio.sleep(delay)
            return await _send(session, url, body, cancel)
        return await asyncio.gather(*(later(b, *p) for b, p in zip(bodies, plan)))


_ALONE: list[str] = []  # each request's answer sent alone: the same on every stack of the default model


def _alone(url: str) -> list[str]:
    if not _ALONE:
        async def one_by_one() -> list[tuple]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                return [await _send(session, url, b) for b in _bodies()]
        answers = asyncio.run(one_by_one())
        assert all(a[0] == "OK" for a in answers), [a for a in answers if a[0] != "OK"][:3]
        _ALONE.extend(a[1] for a in answers)
    return _ALONE


@pytest.mark.parametrize("handoff", ["push", "pull"])
def test_a_preemption_storm_loses_nothing_and_each_preemption_frees_pages(built_engines, tmp_path, handoff):
    s = start_serve(built_engines, tmp_path, "--scheduling-policy", "priority", "--decode", "2",
                    "--handoff", handoff, "--kv-pool-bytes", str(16 * PAGE))
    try:
        alone = _alone(s.http)
        got = asyncio.run(_storm(s.http, _bodies()))
        assert [g for g in got if g[0] not in ("OK", "CANCELLED")] == []
        finished = [i for i, g in enumerate(got) if g[0] == "OK"]
        assert len(finished) >= REQUESTS // 2, got
        assert [i for i in finished if got[i][1] != alone[i]] == []  # exact, preempted or not
        deadline = time.monotonic() + 30
        while any(pages_used(s.http).values()) and time.monotonic() < deadline:
            time.sleep(0.2)  # the last Releases reach the workers
        assert not any(pages_used(s.http).values()), pages_used(s.http)
        preemptions = metric_total(s.http, "tandem_preemptions_total")
        assert 1 <= preemptions <= REQUESTS, preemptions  # it preempted, and not round and round
    finally:
        stop_serve(s)
