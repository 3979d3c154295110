"""The HTTP front door's gate: a request must arrive in time, and under overload a generation request is
refused from its bytes.

A request must arrive whole, its head and its body, within `receive_s` (limits.receive_timeout_s) of its
connection's start or of the previous answer on it: a client that sends a request slowly, or part of one,
or nothing, would otherwise hold its connection, and with enough of them every file descriptor, forever
(the "slowloris" attack). The gate closes a connection whose head is late (with a 408 if any of it came);
the handlers read a body by the same time (`frontdoor/http_body.py` read_body: a 408, then the
connection closes). An idle keep-alive connection is closed by the same clock.

aiohttp spends about a quarter of a millisecond of this process's one event-loop thread on each
request it answers, refusals included (parse, request object, middleware, handler, response). In an
overload burst of hundreds of requests the last refusal then waits for all the ones before it. The gate
sits between the socket and aiohttp's protocol. While the service takes no new request (`refusal`
returns the answer to send), the first request on a connection is refused right here when it is a
generation request (POST to /v1/completions, /v1/chat/completions or the model's KServe infer)
that arrived whole (headers, and all of its Content-Length body, in one read), and not from a web
page (no `Origin` header: a page's refusal needs the CORS headers aiohttp adds, frontdoor/cors.py). It
gets the same status, headers and JSON body as aiohttp would have sent, then `Connection: close`.

Everything else goes to aiohttp untouched: health, metrics, admin, a request in pieces, a chunked
body, pipelined requests, the second request on a keep-alive connection (aiohttp refuses those
itself, before their bodies are read). Whole requests only, so closing leaves no unread bytes behind
and the client reads its answer, not a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import http
import json
import logging
import re
import struct
import termios
from collections.abc import Callable

log = logging.getLogger(__name__)
RECEIVE_S = 30.0  # limits.receive_timeout_s: how long one request may take to arrive whole
SEND_S = 30.0  # limits.send_timeout_s: how long a client may read nothing of an answer being written

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d{1,12})[ \t]*(?=\r\n|$)")


def generation_line(triton_name: str) -> re.Pattern:
    """The request line of a generation request (the routes that check admission before the body):
    the OpenAI completions, and KServe infer for the model's Triton name (another is a 404, not a 429)."""
    model = re.escape(triton_name.encode())
    paths = rb"/v1/completions|/v1/chat/completions|/v2/models/" + model + rb"(?:/versions/1)?/infer"
    return re.compile(rb"POST (?:" + paths + rb")(?:\?[^\s]*)? HTTP/1\.[01]\r\n")


def is_whole(data: bytes) -> bool:
    """One request exactly: its headers end here, its Content-Length body is all here, nothing follows."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False
    head = data[:end].lower()
    if b"\r\ntransfer-encoding:" in head or head.count(b"\r\ncontent-length:") > 1:
        return False
    m = _CONTENT_LENGTH.search(head)
    return len(data) == end + 4 + (int(m.group(1)) if m else 0)


def from_page(data: bytes) -> bool:
    """Whether a request's headers have an Origin (a browser sends one with a page's POSTs)."""
    return b"\r\norigin:" in data[:data.find(b"\r\n\r\n")].lower()


def raw_response(status: int, headers: dict[str, str], body: dict) -> bytes:
    """An HTTP/1.1 answer that closes its connection: status line, headers, a JSON body."""
    payload = json.dumps(body).encode()
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "Content-Type: application/json; charset=utf-8",
             f"Content-Length: {len(payload)}", "Connection: close"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class Turnstile:
    """Generation requests the gates let through whose handlers have not started yet.

    A burst arrives as one batch of reads, all handled before any request handler runs, and admission
    counts a request only once its handler runs. The turnstile counts them in the meantime, so the gate
    of the 33rd request of a burst on a limit of 32 refuses it. Each one leaves it exactly once: when
    its handler starts (`arrived`, called by the front door's middleware) or its connection ends."""

    def __init__(self):
        self.ahead = 0


class Gate(asyncio.Protocol):
    """One connection: aiohttp's protocol (`inner`) behind a check of the connection's first request.

    `refusal(ahead, path)` is the whole answer to send while no request can be taken, with `ahead` more
    let through than admission counts yet, else None. The inner protocol sees the connection from the
    start (aiohttp tracks it for shutdown) and every byte after the first read; a refused connection
    only ever shows it `connection_lost`."""

    def __init__(self, inner: asyncio.Protocol, line: re.Pattern, turnstile: Turnstile,
                 refusal: Callable[[int, str], bytes | None], receive_s: float = RECEIVE_S, late: bytes = b"",
                 on_late: Callable[[], None] = lambda: None, send_s: float = SEND_S):
        """`late`: the whole answer to a request whose head did not arrive in `receive_s`; `on_late()` is
        called as it is sent (not for a connection that sent nothing: it made no request). `send_s`: how
        long the connection's writes may stay paused with none of them read before it is aborted."""
        self.inner, self.line, self.turnstile, self.refusal = inner, line, turnstile, refusal
        self.receive_s, self.late, self.on_late, self.send_s = receive_s, late, on_late, send_s
        self.transport: asyncio.Transport | None = None
        self.first = True
        self.ahead = False  # its request was let through and counts in the turnstile
        self.receive_by = 0.0  # loop time by which the request being sent must be whole (head and body)
        self._clock: asyncio.TimerHandle | None = None  # set while a head is awaited
        self._partial = False  # some of the awaited head came
        self._stalled: asyncio.TimerHandle | None = None  # set while writes are paused

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)
        self.answered()

    def answered(self) -> None:
        """A request was answered (or the connection opened): the next one's clock starts now."""
        self._stop_clock()
        if self.transport is None or self.transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        self.receive_by, self._partial = loop.time() + self.receive_s, False
        self._clock = loop.call_at(self.receive_by, self._head_late)

    def _head_late(self) -> None:
        self._clock = None
        if self.transport is None or self.transport.is_closing():
            return
        log.debug("closing a connection whose request head did not arrive in %.1f s", self.receive_s)
        if self._partial:
            self.on_late()
            self.transport.write(self.late)
        self.transport.close()

    def _stop_clock(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None

    def data_received(self, data: bytes) -> None:
        self._partial = True
        if self.first:
            self.first = False
            if self.line.match(data) and is_whole(data) and not from_page(data):
                answer = self.refusal(self.turnstile.ahead, data.split(b" ", 2)[1].decode("latin-1"))
                if answer is not None:
                    self.transport.write(answer)
                    self.transport.close()
                    return
                self.ahead = True
                self.turnstile.ahead += 1
        self.inner.data_received(data)

    def arrived(self) -> None:
        """A request's head arrived and its handler started (the body is read by `receive_by`); one let
        through by the gate counts in admission from here."""
        self._stop_clock()
        if self.ahead:
            self.ahead = False
            self.turnstile.ahead -= 1

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self.arrived()  # its handler never started, or has started: it leaves the turnstile either way
        self._resumed()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport's buffer is full: the send clock starts, and runs while the client reads none of it."""
        if self._stalled is None:
            self._send_clock(unsent(self.transport))
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self._resumed()
        self.inner.resume_writing()

    def _send_clock(self, unread: int) -> None:
        self._stalled = asyncio.get_running_loop().call_later(self.send_s, self._send_late, unread)

    def _resumed(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _send_late(self, unread: int) -> None:
        """`send_s` after the clock started with `unread` bytes not taken (connection_lost cancels it)."""
        if (now := unsent(self.transport)) < unread:  # the client read some: a slow reader, not a stalled one
            self._send_clock(now)
            return
        self._stalled = None
        log.warning("aborting a connection whose client read nothing of its answer for %g s "
                    "(limits.send_timeout_s); a request it was answering is cancelled", self.send_s)
        self.transport.abort()  # not close(): that would wait for the buffer the client does not read


def unsent(transport: asyncio.Transport) -> int:
    """Bytes written to a connection that its client has not taken: the transport's buffer and, where the
    OS says, the socket's send queue. The transport's buffer alone shows no progress until the client has
    read about a third of the socket's (up to 4 MB): only then does the socket take more."""
    n = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None and hasattr(termios, "TIOCOUTQ"):
        with contextlib.suppress(OSError):
            n += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    return n


def gate_of(request) -> Gate | None:
    """The gate of `request`'s connection (None without one, or once the connection is gone)."""
    gate = request.transport.get_protocol() if request.transport is not None else None
    return gate if isinstance(gate, Gate) else None


def arrived(request) -> None:
    """Tell the gate of `request`'s connection that its handler started (a no-op without a gate)."""
    if (gate := gate_of(request)) is not None:
        gate.arrived()


def answered(request) -> None:
    """Tell the gate of `request`'s connection that it was answered: the next request's clock starts."""
    if (gate := gate_of(request)) is not None:
        gate.answered()
