"""Reading an OpenAI-style server-sent-event stream (our own /v1/*/completions), for our clients:
the benchmark drivers (one-shot and multi-turn) and the chaos harness."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator


async def sse_chunks(resp) -> AsyncIterator[dict]:
    """Each `data:` event of an aiohttp response as a JSON object, until `data: [DONE]` or the end."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[6:])
