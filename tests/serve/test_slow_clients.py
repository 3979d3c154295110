"""A request must arrive whole in time (frontdoor/http_gate.py, `limits.receive_timeout_s`), on a real
1P1D `tandem serve` given 1.5 s: a connection that sends nothing, part of a head, or a head and part of
its body is answered 408 where anything came (in each route's error shape) and closed, so that slow
clients cannot hold connections (and file descriptors) forever; an idle keep-alive connection is closed
by the same clock. A client that sends its request in pieces in time, and an answer that takes longer
than the limit to produce, are served as usual: the clock runs only while a request is awaited."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
import yaml

from tests.conftest import start_serve, stop_serve
from tests.serve.clients import metric_total, post

RECEIVE_S = 1.5
BODY = json.dumps({"prompt": "Name a color.", "max_tokens": 4, "temperature": 0}).encode()


@pytest.fixture(scope="module")
def door(built_engines, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow")
    cfg = tmp / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"limits": {"receive_timeout_s": RECEIVE_S}}))
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
