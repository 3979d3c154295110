"""Calls from web pages of other origins (front_door.cors, frontdoor/cors.py) on a real 1P1D stack with
an API key, admitting one request at a time, as a browser makes them: the preflight is answered before
any key is asked for, and refused with a 400 naming the origin, method or header not allowed; answers,
streams, 401s and the 429 of a full door (which the gate leaves to aiohttp for pages) say the page may
read them; a page of another origin is served without those headers. (A server without CORS says
nothing to any page: tests/serve/test_front_doors.py.)"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse

import pytest
import yaml

from tests.conftest import start_serve, stop_serve
from tests.serve.hold import held

PAGE, OTHER = "https://chat.example.com", "https://elsewhere.example.org"
KEY = "cors-test-api-key-0123456789"
CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
        "temperature": 0}


@pytest.fixture(scope="module")
def paged(built_engines, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-cors")
    (work / "dep.yaml").write_text(yaml.safe_dump({
        "front_door": {"cors": {"allowed_origins": [PAGE], "allowed_methods": ["GET", "POST"],
                                "allowed_headers": ["Authorization", "Content-Type"]}},
        "limits": {"max_in_flight": 1}}))
    s = start_serve(built_engines, work, "--config", str(work / "dep.yaml"), env={"TANDEM_API_KEY": KEY})
    yield s
    stop_serve(s)


def call(url: str, method: str, path: str, headers: dict, body: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers with lower-case names, body) of one HTTP call, the request written whole at once
    (as the gate judges it, frontdoor/http_gate.py)."""
    u = urllib.parse.urlsplit(url)
    data = json.dumps(body).encode() if body is not None else b""
    head = {"Host": u.netloc, "Connection": "close", "Content-Length": str(len(data))} | headers
    if body is not None:
        head["Content-Type"] = "application/json"
    raw = f"{method} {path} HTTP/1.1\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode()
    with socket.create_connection((u.hostname, u.port), timeout=120) as sock:
        sock.sendall(raw + b"\r\n" + data)
        r = http.client.HTTPResponse(sock)
        r.begin()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def preflight(url: str, origin: str, method: str = "POST", headers: str = "authorization, content-type"):
    return call(url, "OPTIONS", "/v1/chat/completions", {"Origin": origin, "Access-Control-Request-Method": method,
                                                         "Access-Control-Request-Headers": headers})


def test_a_preflight_from_an_allowed_page_is_answered_without_a_key(paged):
    status, headers, body = preflight(paged.http, PAGE)
    assert status == 204 and body == b""
    assert headers["access-control-allow-origin"] == PAGE and "origin" in headers["vary"].lower()
    assert headers["access-control-allow-methods"] == "GET, POST"
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert headers["access-control-max-age"] == "600" and "access-control-allow-credentials" not in headers


@pytest.mark.parametrize("origin, method, asked, named", [
    (OTHER, "POST", "content-type", "origin"),
    (PAGE, "DELETE", "content-type", "method"),
    (PAGE, "POST", "content-type, x-debug", "header 'x-debug'"),
])
def test_a_preflight_asking_what_is_not_allowed_is_a_400_naming_it(paged, origin, method, asked, named):
    status, headers, body = preflight(paged.http, origin, method, asked)
    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["code"] == "INVALID_ARGUMENT" and f"CORS: {named}" in error["message"], error
    assert ("access-control-allow-origin" in headers) == (origin == PAGE)  # the allowed page may read why


def test_an_allowed_pages_answers_and_errors_say_it_may_read_them(paged):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, plain, want = call(paged.http, "POST", "/v1/chat/completions", auth, CHAT)
    assert status == 200 and "access-control-allow-origin" not in plain  # no Origin: no CORS headers
    status, headers, got = call(paged.http, "POST", "/v1/chat/completions", auth | {"Origin": PAGE}, CHAT)
    assert status == 200 and headers["access-control-allow-origin"] == PAGE
    assert json.loads(got)["choices"] == json.loads(want)["choices"]
    assert headers["access-control-expose-headers"] == "X-Request-Id, Retry-After" and headers["x-request-id"]
    status, headers, streamed = call(paged.http, "POST", "/v1/chat/completions", auth | {"Origin": PAGE},
                                     CHAT | {"stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["access-control-allow-origin"] == PAGE and streamed.rstrip().endswith(b"data: [DONE]")
    status, headers, _ = call(paged.http, "POST", "/v1/chat/completions", {"Origin": PAGE}, CHAT)  # no key
    assert status == 401 and headers["access-control-allow-origin"] == PAGE
    status, headers, _ = call(paged.http, "POST", "/v1/chat/completions", auth | {"Origin": OTHER}, CHAT)
    assert status == 200 and "access-control-allow-origin" not in headers  # served; its page may not read it


def test_a_full_doors_429_reaches_the_page_with_its_cors_headers(paged):
    auth = {"Authorization": f"Bearer {KEY}"}
    with held(paged, headers=auth) as first:  # the one place taken
        status, headers, body = call(paged.http, "POST", "/v1/chat/completions", auth | {"Origin": PAGE}, CHAT)
        assert status == 429 and json.loads(body)["error"]["code"] == "RESOURCE_EXHAUSTED"
        assert headers["access-control-allow-origin"] == PAGE and headers["retry-after"]
        assert "server" in headers  # aiohttp's answer: the gate left a page's request to it
        status, headers, _ = call(paged.http, "POST", "/v1/chat/completions", auth, CHAT)
        assert status == 429 and "server" not in headers  # the gate's own answer, to a request not from a page
    assert first.result()[0] == 200
