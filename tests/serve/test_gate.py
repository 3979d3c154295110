"""The HTTP gate (frontdoor/http_gate.py) over real sockets, in front of a real aiohttp server and a
real Admission: a burst beyond the limit is refused from its bytes with the answer aiohttp would have
sent; everything the gate must not judge reaches aiohttp. (The whole stack's overload burst, through
the same gate, is tests/faults/test_chaos.py.) An answer its client reads none of for SEND_S is aborted and
its handler cancelled; a client that reads slowly keeps it however long the server's writes stay paused.
(The whole stack's, a real stream left unread, is tests/serve/test_slow_clients.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket

from aiohttp import web

from control.admission import Admission
from frontdoor.http_app import error_parts, error_response, raw_refusal
from frontdoor.http_gate import Gate, Turnstile, arrived, generation_line, is_whole
from tandem.status import ResourceExhausted, TandemError

LIMIT = 4
SEND_S = 0.5
BODY = json.dumps({"prompt": "Name a color.", "max_tokens": 4}).encode()


def request(body: bytes = BODY, path: str = "/v1/completions", more: str = "") -> bytes:
    """A whole POST; `more`: further header lines, each ending in CRLF."""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{more}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Door:
    """An aiohttp app behind gates: POST /v1/completions takes an admission place and holds it until
    `release` is set; /health and /admin/flush answer at once."""

    def __init__(self):
        self.admission = Admission(max_in_flight=LIMIT)
        self.turnstile = Turnstile()
        self.release = asyncio.Event()
        self.handled: list[str] = []
        self.written, self.streaming = 0, None  # GET /stream: bytes written; True while its handler runs

    @web.middleware
    async def middleware(self, request, handler):
        arrived(request)  # as HttpFrontend's middleware does
        self.handled.append(request.path)
        try:
            return await handler(request)
        except TandemError as e:
            return error_response(e)

    async def completions(self, request):
        await request.read()
        ticket = self.admission.admit(1)
        try:
            await self.release.wait()
        finally:
            ticket.close()
        return web.json_response({"ok": True})

    async def small(self, request):
        return web.json_response({"path": request.path})

    async def stream(self, request):
        """64 kB pieces, as fast as the client takes them, up to 64 MB."""
        resp = web.StreamResponse()
        await resp.prepare(request)
        self.streaming = True
        try:
            for _ in range(1024):
                await resp.write(b"x" * 65536)
                self.written += 65536
        finally:
            self.streaming = False
        return resp

    async def start(self) -> int:
        app = web.Application(middlewares=[self.middleware])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.small)
        app.router.add_post("/admin/flush", self.small)
        app.router.add_get("/stream", self.stream)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        line = generation_line("ensemble")
        refusal = functools.partial(raw_refusal, self.admission.check)  # as start_http's, on our admission
        self.listener = await asyncio.get_running_loop().create_server(
            lambda: Gate(self.runner.server(), line, self.turnstile, refusal, send_s=SEND_S), "127.0.0.1", 0)
        return self.listener.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.release.set()
        self.listener.close()
        await self.runner.cleanup()


def at_the_door(test) -> None:
    """Run `test(door, port)` against a started Door, stopped afterwards."""
    async def main():
        door = Door()
        port = await door.start()
        try:
            await test(door, port)
        finally:
            await door.stop()
    asyncio.run(main())


async def send_all(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """`n` connections, opened first, then one whole request written on each."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
    for _, w in conns:
        w.write(request())
    return conns


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := (await reader.readline()).strip()):
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return status, headers, await reader.readexactly(int(headers["content-length"]))


def test_a_burst_beyond_the_limit_is_refused_at_the_gate_as_aiohttp_would_refuse_it():
    async def test(door, port):
        conns = await send_all(port, 5 * LIMIT)  # all at once, before any handler has run
        refused = await asyncio.gather(*[answer(r) for r, _ in conns[LIMIT:]])
        # exactly LIMIT reached the handler (they hold their places); the others never reached aiohttp
        assert door.handled == ["/v1/completions"] * LIMIT
        assert door.admission.in_flight == LIMIT and door.turnstile.ahead == 0
        expected = error_parts(ResourceExhausted(f"{LIMIT} requests in flight (limit {LIMIT}); "
                                                 f"retry after a moment"))
        for status, headers, body in refused:
            assert status == expected[0] == 429
            assert headers["retry-after"] == expected[1]["Retry-After"] == "1"
            assert headers["connection"] == "close" and headers["content-type"].startswith("application/json")
            assert json.loads(body) == expected[2]
            assert json.loads(body)["error"]["code"] == "RESOURCE_EXHAUSTED"
        for r, w in conns[LIMIT:]:
            assert await r.read() == b""  # the gate closed the connection after its answer
            w.close()
        door.release.set()
        done = await asyncio.gather(*[answer(r) for r, _ in conns[:LIMIT]])
        assert [s for s, _, _ in done] == [200] * LIMIT
        for _, w in conns[:LIMIT]:
            w.close()
    at_the_door(test)


def test_what_the_gate_must_not_judge_reaches_aiohttp():
    async def test(door, port):
        held = await send_all(port, LIMIT)
        while door.admission.in_flight < LIMIT:  # the limit is reached: the gate is closed now
            await asyncio.sleep(0.01)

        async def send(*parts: bytes) -> tuple[int, dict[str, str], bytes]:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            for p in parts:
                w.write(p)
                await w.drain()
                await asyncio.sleep(0.05)  # each part its own read
            try:
                return await answer(r)
            finally:
                w.close()

        before = len(door.handled)
        health = await send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        flush = await send(request(b"{}", "/admin/flush"))
        raw = request()
        split = await send(raw[:20], raw[20:])  # in pieces: aiohttp refuses it itself
        other = await send(request(path="/v2/models/other/infer"))  # not this model's: aiohttp's 404
        page = await send(request(more="Origin: https://chat.example.com\r\n"))  # a web page's: CORS headers to add
        assert (health[0], flush[0], split[0], other[0], page[0]) == (200, 200, 429, 404, 429)
        assert door.handled[before:] == ["/health", "/admin/flush", "/v1/completions", "/v2/models/other/infer",
                                         "/v1/completions"]
        assert "server" in page[1]
        assert json.loads(split[2])["error"]["code"] == "RESOURCE_EXHAUSTED"
        assert "server" in split[1]  # aiohttp's own answer (the gate's names no server)

        # a keep-alive connection's second request is aiohttp's to judge, not the gate's
        door.release.set()
        for r, w in held:
            assert (await answer(r))[0] == 200
        door.release.clear()
        fill = await send_all(port, LIMIT)
        while door.admission.in_flight < LIMIT:
            await asyncio.sleep(0.01)
        r, w = held[0]
        w.write(request())
        again = await answer(r)
        assert again[0] == 429 and "server" in again[1]
        assert door.turnstile.ahead == 0
        for _, w in held + fill:
            w.close()
    at_the_door(test)


def test_a_request_let_through_whose_client_leaves_at_once_gives_its_place_back():
    async def test(door, port):
        for _, w in await send_all(port, 2 * LIMIT):
            w.close()  # gone before any answer, perhaps before its handler runs
        for _ in range(200):
            if door.turnstile.ahead == 0 and door.admission.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert (door.turnstile.ahead, door.admission.in_flight) == (0, 0)
        r, w = await asyncio.open_connection("127.0.0.1", port)  # and the door is open again
        w.write(request())
        while door.admission.in_flight < 1:
            await asyncio.sleep(0.01)
        door.release.set()
        assert (await answer(r))[0] == 200
        w.close()
    at_the_door(test)


def test_only_one_whole_request_is_judged_from_its_bytes():
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n"
    assert is_whole(head + b"{}")
    assert not is_whole(head + b"{")  # the body is not all here
    assert not is_whole(head + b"{}" + head + b"{}")  # pipelined: another request follows
    assert not is_whole(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers not ended
    assert not is_whole(b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert not is_whole(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}")
    assert is_whole(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")  # no body: aiohttp reads none either
    line = generation_line("ensemble")
    for ok in (b"POST /v1/completions HTTP/1.1\r\n", b"POST /v1/chat/completions HTTP/1.0\r\n",
               b"POST /v2/models/ensemble/infer HTTP/1.1\r\n",
               b"POST /v2/models/ensemble/versions/1/infer?a=b HTTP/1.1\r\n"):
        assert line.match(ok), ok
    for no in (b"GET /v1/completions HTTP/1.1\r\n", b"POST /v1/completions2 HTTP/1.1\r\n",
               b"POST /v2/models/ensemble/versions/2/infer HTTP/1.1\r\n", b"POST /admin/flush HTTP/1.1\r\n",
               b"POST /v2/models/ensemblex/infer HTTP/1.1\r\n"):
        assert not line.match(no), no


async def held_up(door, port: int, read_every_s: float) -> socket.socket:
    """A connection streaming GET /stream into a small receive buffer, read 16 kB per `read_every_s`
    (never, for None) until the server has written nothing for 6 x SEND_S."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    written, since = -1, loop.time()
    while loop.time() - since < 6 * SEND_S:
        if read_every_s is not None:
            assert await loop.sock_recv(sock, 16384), "the server closed the connection of a client that reads"
        await asyncio.sleep(read_every_s or 0.05)
        if door.written != written:
            written, since = door.written, loop.time()
        elif read_every_s is None and not door.streaming:
            break  # cut off
    return sock


def test_a_client_that_reads_none_of_its_answer_is_cut_off_and_one_that_reads_slowly_is_not():
    async def test(door, port):
        slow = await held_up(door, port, 0.1)  # ~160 kB/s: the socket takes more only once ~1 MB is read
        assert door.streaming, "a slow reader was cut off"
        slow.close()
        while door.streaming:  # it left: its handler is cancelled
            await asyncio.sleep(0.01)
        door.written = 0
        stalled = await held_up(door, port, None)
        assert door.streaming is False and 0 < door.written < 64 << 20, "an unread answer was not cut off"
        with contextlib.suppress(ConnectionResetError):  # what the buffers held, then the end (or a reset)
            while await asyncio.get_running_loop().sock_recv(stalled, 65536):
                pass
        stalled.close()
    at_the_door(test)
