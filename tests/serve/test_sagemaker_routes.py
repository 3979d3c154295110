"""SageMaker's routes, as vLLM serves them, on the session's real stacks: POST /invocations answers a
chat body as /v1/chat/completions and a completion body as /v1/completions (whole and streamed), and
refuses any other body with a 400 naming what it takes; GET and POST /ping answer as /health, without
a key where the doors take keys (a probe), while /invocations still wants one."""

from __future__ import annotations

import urllib.request

from tests.conftest import GUARD_KEY
from tests.serve.clients import post
from tests.serve.test_door_conformance import http

CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


def test_invocations_answers_a_chat_or_a_completion_by_its_body(served):
    for body, route in ((CHAT, "/v1/chat/completions"), (COMPLETION, "/v1/completions")):
        status, want = post(served.http, route, body)
        assert status == 200, want
        status, got = post(served.http, "/invocations", body)
        assert status == 200 and got["object"] == want["object"] and got["choices"] == want["choices"], got
        status, events = post(served.http, "/invocations", body | {"stream": True})
        assert status == 200 and isinstance(events, list) and events, events  # SSE chunks
        pieces = [e["choices"][0].get("delta", {}).get("content") or e["choices"][0].get("text") or ""
                  for e in events if e["choices"]]
        whole = want["choices"][0]
        assert "".join(pieces) == (whole["message"]["content"] if "message" in whole else whole["text"])


def test_invocations_refuses_a_body_that_is_neither(served):
    status, reply, _ = http(served.http, "/invocations", {"input": "Hi"})
    assert status == 400 and "messages" in reply["error"]["message"] and "prompt" in reply["error"]["message"]


def test_ping_is_an_open_probe_and_invocations_wants_the_key(guarded):
    for method in ("GET", "POST"):
        req = urllib.request.Request(guarded.http + "/ping", method=method, data=b"" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
    status, _ = post(guarded.http, "/invocations", COMPLETION)
    assert status == 401
    status, got = post(guarded.http, "/invocations", COMPLETION, headers={"Authorization": f"Bearer {GUARD_KEY}"})
    assert status == 200 and got["choices"][0]["text"], got
