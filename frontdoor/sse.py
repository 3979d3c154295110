"""Server-Sent Events helpers shared by the HTTP doors that stream (OpenAI and Triton's generate_stream)."""

from __future__ import annotations

import json

from aiohttp import web


async def first_delta(deltas):
    """The first delta (None if the stream is empty); raises the request's error before any byte is sent,
    so a refusal is still an HTTP status, not an event."""
    try:
        return await deltas.__anext__()
    except StopAsyncIteration:
        return None


async def send_event(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
