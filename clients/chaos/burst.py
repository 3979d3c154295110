"""An overload burst as a load balancer sends it: connections opened beforehand, then every request
written in one pass, each timed from its own write to its answer's status line.

Why not aiohttp, like the other scenarios: a Python client spends more CPU to open a connection and
send one request through aiohttp (about a millisecond) than the server spends refusing it (tens of
microseconds). With hundreds of requests sent at once from one client process on the server's own
cores, the client's queue, not the server, would set the refusal times. Opening the connections first
(as the keep-alive pool of a proxy in front of the server holds them) and stamping each request when
it is written measures what the server does with a burst.

HTTP/1.0 with `Connection: close`: the answer is the raw body up to the end of the connection (no
chunked framing), a JSON error for a refusal, or server-sent events for an accepted stream.

`in_own_process` runs the burst in a child process (the harness's canaries and load must not share
its event loop), which prints one JSON object per request:

    python -m clients.chaos.burst URL PROMPT MAX_TOKENS N TIMEOUT_S
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from urllib.parse import urlsplit

from clients.chaos.client import Outcome, error_code, take_event


def _request(host: str, body: bytes, timeout_s: float) -> bytes:
    head = (f"POST /v1/completions HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nTandem-Timeout: {timeout_s}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def burst(url: str, prompt: str, max_tokens: int, n: int, timeout_s: float = 120.0) -> list[Outcome]:
    """`n` greedy streamed requests for `prompt`, written at once; one Outcome each (kind "burst").

    An Outcome's `start` is its write, its `end` the status line for a refusal or the stream's end for
    an accepted request; a connection that fails is status TRANSPORT (...), as in client.py."""
    parts = urlsplit(url)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    raw = _request(parts.netloc, body, timeout_s)
    conns = [await asyncio.open_connection(parts.hostname, parts.port) for _ in range(n)]
    outs = []
    for _, writer in conns:
        outs.append(Outcome("burst", prompt, time.monotonic()))
        writer.write(raw)  # the transport sends at once: the socket is writable and its buffer empty
    await asyncio.wait_for(asyncio.gather(*[_answer(r, w, o) for (r, w), o in zip(conns, outs)]), timeout_s + 10)
    return outs


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, out: Outcome) -> None:
    try:
        status_line = await reader.readline()
        out.end = time.monotonic()
        out.http = int(status_line.split()[1])
        while (await reader.readline()).strip():
            pass  # headers: nothing in them is needed
        if out.http != 200:
            out.status = error_code(await reader.read(), out.http)
            return
        async for line in reader:
            text = line.decode().strip()
            if not text.startswith("data: "):
                continue
            if text == "data: [DONE]":
                out.status = "OK"
                break
            if not take_event(out, json.loads(text[6:])):
                break
        out.status = out.status or "TRANSPORT (stream ended without [DONE])"
        out.end = time.monotonic()
    except (ConnectionError, OSError, IndexError, ValueError) as e:
        out.status = f"TRANSPORT ({type(e).__name__})"
        out.end = time.monotonic()
    finally:
        writer.close()


async def in_own_process(url: str, prompt: str, max_tokens: int, n: int, timeout_s: float = 120.0) -> list[Outcome]:
    """`burst`, sent from a child process. Outcome times are CLOCK_MONOTONIC, the same in both."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "clients.chaos.burst", url, prompt,
                                                str(max_tokens), str(n), str(timeout_s),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the burst client failed ({proc.returncode}): {err.decode()[-2000:]}")
    return [Outcome(**json.loads(line)) for line in out.decode().splitlines()]


def main(argv: list[str]) -> None:
    url, prompt, max_tokens, n, timeout_s = argv
    for o in asyncio.run(burst(url, prompt, int(max_tokens), int(n), float(timeout_s))):
        print(json.dumps(dataclasses.asdict(o)))


if __name__ == "__main__":
    main(sys.argv[1:])
