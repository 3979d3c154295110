"""A request must arrive whole in time (frontdoor/http_gate.py, `limits.receive_timeout_s`), on a real
1P1D `tandem serve` given 1.5 s: a connection that sends nothing, part of a head, or a head and part of
its body is answered 408 where anything came (in each route's error shape) and closed, so that slow
clients cannot hold connections (and file descriptors) forever; an idle keep-alive connection is closed
by the same clock. A client that sends its request in pieces in time, and an answer that takes longer
than the limit to produce, are served as usual: the clock runs only while a request is awaited.

An answer must be read (`limits.send_timeout_s`, 1.5 s here): a client that stops reading its stream, over
HTTP or a gRPC stream, is cut off and its request cancelled, its place in admission and its pages given
back (before, such a client held its request forever, and `max_in_flight` of them locked every other
client out with 429s); a gRPC client that reads slowly, but reads, is served to the end. (An HTTP client
that reads slowly while the server's writes stay paused: tests/serve/test_gate.py.)

A gRPC connection older than `front_door.grpc_max_connection_age_s` (1 s here) is asked to reconnect:
its call in flight is served to the end, and the client's next call comes on a new connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from urllib.parse import urlsplit

import grpc
import pytest
import yaml
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from tests.conftest import start_serve, stop_serve
from tests.serve.clients import metric_total, pages_used, post
from tests.serve.test_door_conformance import grpc_request

RECEIVE_S = SEND_S = 1.5
AGE_S = 1.0  # front_door.grpc_max_connection_age_s
BODY = json.dumps({"prompt": "Name a color.", "max_tokens": 4, "temperature": 0}).encode()


@pytest.fixture(scope="module")
def door(built_engines, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow")
    cfg = tmp / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"limits": {"receive_timeout_s": RECEIVE_S, "send_timeout_s": SEND_S},
                                   "front_door": {"grpc_max_connection_age_s": AGE_S}}))
    s = start_serve(built_engines, tmp, "--config", str(cfg))
    yield s
    stop_serve(s)


def connect(s) -> socket.socket:
    u = urlsplit(s.http)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def head(path: str = "/v1/completions", length: int = len(BODY)) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def parsed(raw: bytes) -> tuple[int, dict]:
    top, _, body = raw.partition(b"\r\n\r\n")
    return int(top.split(b" ", 2)[1]), json.loads(body)


def late_requests(s) -> float:
    """The requests refused as late so far."""
    return metric_total(s.http, "tandem_request_failures_total", 'status="REQUEST_TIMEOUT"')


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(door):
    before = late_requests(door)
    with connect(door) as sock:
        data, took = until_closed(sock)
    assert data == b"" and RECEIVE_S - 0.2 < took < RECEIVE_S + 10, took
    assert late_requests(door) == before  # no request was made


def test_a_late_head_is_answered_408_and_closed(door):
    before = late_requests(door)
    with connect(door) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        data, took = until_closed(sock)
    status, body = parsed(data)
    assert status == 408 and body["error"]["code"] == "REQUEST_TIMEOUT", data
    assert "receive_timeout_s" in body["error"]["message"] and took < RECEIVE_S + 10
    assert late_requests(door) == before + 1  # counted as a request refused


@pytest.mark.parametrize("path, shape", [("/v1/completions", "openai"), ("/v2/models/ensemble/infer", "kserve"),
                                         ("/v1/messages", "anthropic")])
def test_a_late_body_is_answered_408_in_the_routes_shape_and_closed(door, path, shape):
    before = late_requests(door)
    with connect(door) as sock:
        sock.sendall(head(path) + BODY[:5])  # the head whole, the body never
        data, took = until_closed(sock)
    status, body = parsed(data)
    assert status == 408, data
    message = {"openai": lambda: body["error"]["message"], "kserve": lambda: body["error"],
               "anthropic": lambda: body["error"]["message"]}[shape]()
    assert "did not arrive whole" in message and "receive_timeout_s" in message, body
    assert took < RECEIVE_S + 10 and late_requests(door) == before + 1


def test_a_request_sent_in_pieces_in_time_is_served_and_an_idle_connection_is_closed_after(door):
    with connect(door) as sock:
        for piece in (head()[:20], head()[20:], BODY[:7], BODY[7:]):
            sock.sendall(piece)
            time.sleep(RECEIVE_S / 6)
        sock.settimeout(60)
        data, idle = until_closed(sock)  # the answer, then the idle connection is closed
    status, body = parsed(data)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), data
    assert idle < RECEIVE_S + 10


def test_an_answer_that_takes_longer_than_the_limit_is_not_cut(door):
    start = time.monotonic()
    code, answer = post(door.http, "/v1/completions", {"prompt": "Tell a long story.", "max_tokens": 200,
                                                       "ignore_eos": True, "temperature": 0, "stream": True})
    took = time.monotonic() - start
    assert code == 200 and answer[-1]["choices"][0]["finish_reason"] == "length", answer[-1]
    assert sum(1 for e in answer if e["choices"] and e["choices"][0]["text"]) >= 190
    assert took > RECEIVE_S, f"the answer took {took:.2f} s: make it longer than the limit"


# -- answers that are not read ------------------------------------------------------------------------

# ~2.5 kB per token (20 alternatives); 8 choices of them fill the ~3 MB that loopback's buffers hold in ~20 s
CHAT_LONG = {"messages": [{"role": "user", "content": "Tell a long story."}], "n": 8, "max_tokens": 1500,
             "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}


def small_window(door) -> socket.socket:
    """A connection whose receive buffer is small, so that what the client does not read holds up the server."""
    u = urlsplit(door.http)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect((u.hostname, u.port))
    return sock


def cancelled(door) -> float:
    return metric_total(door.http, "tandem_request_failures_total", 'status="CANCELLED"')


def until_busy(door) -> None:
    """Wait until a request is in flight."""
    start = time.monotonic()
    while not metric_total(door.http, "tandem_requests_in_flight"):
        assert time.monotonic() - start < 30, "the request was not admitted"
        time.sleep(0.05)


def until_idle(door, limit_s: float = 90) -> None:
    """Wait until no request is in flight and no KV page is held (fails after `limit_s`)."""
    start = time.monotonic()
    while metric_total(door.http, "tandem_requests_in_flight") or sum(pages_used(door.http).values()):
        assert time.monotonic() - start < limit_s, "the request still holds its place and pages"
        time.sleep(0.25)


def test_a_client_that_stops_reading_its_stream_is_cut_off_and_its_request_cancelled(door):
    before = cancelled(door)
    body = json.dumps(CHAT_LONG).encode()
    with small_window(door) as sock:
        sock.sendall(head("/v1/chat/completions", len(body)) + body)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "the stream did not start"
        until_busy(door)
        until_idle(door)  # the client reads nothing more
        data = b""
        with contextlib.suppress(ConnectionResetError):  # what the buffers held, then the end (or a reset)
            while chunk := sock.recv(65536):
                data += chunk
    assert b"data: [DONE]" not in data and b'"finish_reason": "length"' not in data, "the answer was not cut"
    assert cancelled(door) == before + CHAT_LONG["n"]  # each choice is a request of its own
    code, answer = post(door.http, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert code == 200 and answer["choices"][0]["finish_reason"] == "length", answer


SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]  # ~10 responses


def story(tokens: int):
    return grpc_request({"text_input": (["Tell a long story."], "BYTES"), "max_tokens": ([tokens], "INT32"),
                         "min_tokens": ([tokens], "INT32"), "stream": ([True], "BOOL")})


async def _unread_stream(door) -> grpc.aio.AioRpcError:
    """A gRPC stream whose client reads none of its responses (a 1 kB window) until the server gave back
    the request's place and pages; then the error the client reads at the stream's end."""
    async with grpc.aio.insecure_channel(door.grpc, options=SMALL_WINDOW) as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
        await call.write(story(2000))
        await call.done_writing()
        await asyncio.to_thread(until_busy, door)
        await asyncio.to_thread(until_idle, door)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async with asyncio.timeout(60):
                async for _ in call:
                    pass
        return ended.value


def test_a_grpc_stream_whose_client_reads_nothing_is_ended_and_its_request_cancelled(door):
    before = cancelled(door)
    ended = asyncio.run(_unread_stream(door))
    assert ended.code() == grpc.StatusCode.CANCELLED and "send_timeout_s" in ended.details(), ended
    assert cancelled(door) == before + 1
    code, answer = post(door.http, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert code == 200, answer


async def _read_stream(channel, tokens: int, every_s: float = 0.0) -> tuple[int, float]:
    """(responses, seconds) of one gRPC stream of a `tokens`-token story on `channel`, read one response
    per `every_s`."""
    call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
    await call.write(story(tokens))
    await call.done_writing()
    start, responses = time.monotonic(), 0
    async for response in call:
        assert not response.error_message, response.error_message
        responses += 1
        await asyncio.sleep(every_s)
    return responses, time.monotonic() - start


async def _slowly_read_stream(door, tokens: int, every_s: float) -> tuple[int, float]:
    """A stream read one response per `every_s` through a small window."""
    async with grpc.aio.insecure_channel(door.grpc, options=SMALL_WINDOW) as channel:
        return await _read_stream(channel, tokens, every_s)


def test_a_grpc_stream_read_slowly_is_served_to_the_end(door):
    responses, took = asyncio.run(_slowly_read_stream(door, 120, 0.05))
    assert responses >= 100  # one per piece of new text
    assert took > 4 * SEND_S, f"read in {took:.1f} s: too fast to have held the server up"


# -- connections past their age -------------------------------------------------------------------------

async def _calls_on_one_channel(door, lengths: tuple[int, ...]) -> list[tuple[int, float]]:
    """Streamed answers of these lengths, one after the other, on one client channel."""
    async with grpc.aio.insecure_channel(door.grpc) as channel:
        return [await _read_stream(channel, tokens) for tokens in lengths]


def grpc_stream_peers(door, since: int) -> list[str]:
    """The client address (host:port) of each gRPC stream logged after byte `since` of the log."""
    with open(door.log_path, errors="replace") as f:
        f.seek(since)
        return [line.split("peer=", 1)[1].split()[0] for line in f if "ModelStreamInfer" in line and "peer=" in line]


def test_a_grpc_connection_past_its_age_serves_its_call_to_the_end_and_the_next_call_reconnects(door):
    since = os.path.getsize(door.log_path)
    (long_n, long_s), (short_n, _) = asyncio.run(_calls_on_one_channel(door, (80, 4)))
    assert long_s > 1.5 * AGE_S, f"the first answer took {long_s:.2f} s: make it outlive the connection's age"
    assert long_n >= 70 and short_n >= 2, (long_n, short_n)  # one response per piece of new text
    peers = grpc_stream_peers(door, since)
    assert len(peers) == 2 and peers[0] != peers[1], peers  # the second call came on a new connection
