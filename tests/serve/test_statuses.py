"""Every status maps to one gRPC code and one HTTP status, from one table; each row is reached for real
(bad input, unknown model, pool full, over admission limits, deadline, worker died) on a small stack."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from frontdoor.http_app import error_response
from frontdoor.protocol_status import grpc_code, http_headers, http_status
from tandem.status import STATUS_TABLE, Status, error_for, status_of
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import ensemble_inputs, pages_used, post

CLIENT_FAULTS = {Status.INVALID_ARGUMENT, Status.NOT_FOUND, Status.METHOD_NOT_ALLOWED, Status.TOO_LARGE, Status.REQUEST_TIMEOUT,
                 Status.UNAUTHENTICATED}


def test_the_table_covers_every_status_and_blames_no_client_for_a_server_fault():
    assert set(STATUS_TABLE) == set(Status)
    for status, info in STATUS_TABLE.items():
        assert isinstance(grpc_code(status), grpc.StatusCode)
        if status is Status.OK:
            continue
        err = error_for(status, "why")
        assert status_of(err) is status  # the exception type carries the status both ways
        resp = error_response(err)
        assert resp.status == info.http == http_status(status)
        body = json.loads(resp.body)
        assert body["error"]["code"] == status.value and body["error"]["message"] == "why"
        assert ("Retry-After" in resp.headers) == info.retryable == bool(http_headers(status))
        if 400 <= info.http < 500 and info.http not in (429, 499):
            assert status in CLIENT_FAULTS, status  # a 4xx other than "busy"/"gone" is the client's fault
        if status not in CLIENT_FAULTS and status is not Status.CANCELLED:
            assert info.http >= 429, status


def _pages_bytes(pages: int) -> int:
    return pages * 16 * 46080  # the default model: 46080 KV bytes per token, 16 tokens per page


@pytest.fixture(scope="module")
def small(built_engines, tmp_path_factory):
    """1P1D with a 5-page decode pool (80 tokens) and at most two requests in flight."""
    work = tmp_path_factory.mktemp("serve-small")
    cfg = work / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"limits": {"max_in_flight": 2}}))
    s = start_serve(built_engines, work, "--config", str(cfg), "--kv-pool-bytes", str(_pages_bytes(5)))
    yield s
    stop_serve(s)


def _grpc_error(url: str, inputs, timeout_s: float | None = None) -> InferenceServerException:
    c = grpcclient.InferenceServerClient(url)
    try:
        with pytest.raises(InferenceServerException) as e:
            c.infer("ensemble", inputs, client_timeout=timeout_s)
        return e.value
    finally:
        c.close()


def _complete(http: str, prompt: str, tokens: int, timeout_s: float) -> tuple[int, dict]:
    return post(http, "/v1/completions", {"prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
                                          "temperature": 0}, headers={"Tandem-Timeout": str(timeout_s)})


def _decode_tries(http: str) -> float:
    """`tandem_worker_requests_total{role="decode"}`: the tries the front door sent to decode workers."""
    with urllib.request.urlopen(http + "/metrics") as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[1]) for line in lines
               if line.startswith("tandem_worker_requests_total{") and 'role="decode"' in line)


def test_a_request_no_pool_can_hold_is_a_client_error_at_once(small):
    t = time.monotonic()
    status, body = post(small.http, "/v1/completions", {"prompt": "hi", "max_tokens": 100})
    assert status == 400 and "largest decode pool has 5" in body["error"]["message"]
    assert time.monotonic() - t < 2
    err = _grpc_error(small.grpc, ensemble_inputs(grpcclient, "hi", 100, False))
    assert err.status() == "StatusCode.INVALID_ARGUMENT"


def test_pool_full_past_the_deadline_is_429_and_over_admission_limits_is_429_at_once(small):
    """The holder reserves 4 of the 5 pages and waits for its prefill, the prefill worker being stopped
    (SIGSTOP, well under the 4 s stall limit): its pages stay taken however fast decoding is."""
    prefill = small.workers()["prefill-0"]["pid"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        os.killpg(prefill, signal.SIGSTOP)
        try:
            holder = pool.submit(_complete, small.http, "Once upon a time", 60, 60)  # 4 of the 5 pages
            until = time.monotonic() + 30
            while sum(pages_used(small.http).values()) < 4 and time.monotonic() < until:  # the holder has them
                time.sleep(0.05)
            tries = _decode_tries(small.http)
            waiting = pool.submit(_complete, small.http, "The sky is", 20, 1.0)  # 2 pages: waits, then gives up
            time.sleep(0.3)
            t = time.monotonic()
            status, body = post(small.http, "/v1/completions", {"prompt": "hi", "max_tokens": 4})  # a third: over 2
            refused_in = time.monotonic() - t
            assert status == 429 and body["error"]["code"] == "RESOURCE_EXHAUSTED", body
            assert refused_in < 0.5
            status, body = waiting.result(timeout=60)
            assert status == 429 and body["error"]["code"] == "OUT_OF_PAGES", body
            # it slept until a worker's state changed and tried again (4-5 tries in its second here), never in
            # a loop of refused tries woken by its own try's end (913 in its second before that was fixed)
            assert _decode_tries(small.http) - tries <= 20
        finally:
            os.killpg(prefill, signal.SIGCONT)
        assert holder.result(timeout=120)[0] == 200
    status, body = post(small.http, "/v1/completions", {"prompt": "The sky is", "max_tokens": 4})
    assert status == 200, body  # the pages all came back


def test_a_request_past_its_deadline_is_504(small):
    status, body = _complete(small.http, "Once upon a time", 60, 0.5)  # 60 tokens take seconds here
    assert status == 504 and body["error"]["code"] == "DEADLINE_EXCEEDED", body
    # its pages come back a moment after the 504 (the release is asynchronous); the gRPC request below
    # needs 4 of the 5, and without them its deadline would end as OUT_OF_PAGES instead
    deadline = time.monotonic() + 10
    while any(pages_used(small.http).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    c = grpcclient.InferenceServerClient(small.grpc)
    try:
        with pytest.raises(InferenceServerException) as e:  # gRPC's own deadline bounds the request too
            c.infer("ensemble", ensemble_inputs(grpcclient, "Once upon a time", 60, False,
                                                {"min_tokens": (np.array([[60]], dtype=np.int32), "INT32")}), client_timeout=0.5)
        assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED", e.value.message()
    finally:
        c.close()
    time.sleep(1.0)
    assert post(small.http, "/v1/completions", {"prompt": "The sky is", "max_tokens": 4})[0] == 200


def test_a_request_that_waited_for_pages_then_got_them_ends_its_deadline_as_504(small):
    """It waited (pool full), a worker freed pages and reserved them for it, and its deadline passed during
    its prefill: that is the request's own deadline (504), not a wait for pages (it ended 429 before).
    The prefill worker is stopped (SIGSTOP, well under the 4 s stall limit) before the holder comes, so
    the holder keeps its pages until its own deadline, and the prefill outlasts the waiting one's too."""
    prefill = small.workers()["prefill-0"]["pid"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        os.killpg(prefill, signal.SIGSTOP)
        try:
            holder = pool.submit(_complete, small.http, "Once upon a time", 60, 1.0)  # 4 of the 5 pages, until 1 s
            until = time.monotonic() + 30
            while sum(pages_used(small.http).values()) < 4 and time.monotonic() < until:
                time.sleep(0.05)
            waiting = pool.submit(_complete, small.http, "The sky is", 20, 2.0)  # 2 pages: waits for the holder's
            assert holder.result(timeout=30)[0] == 504  # its deadline gives its pages back
            status, body = waiting.result(timeout=30)
        finally:
            os.killpg(prefill, signal.SIGCONT)
    assert status == 504 and body["error"]["code"] == "DEADLINE_EXCEEDED", body
    deadline = time.monotonic() + 30
    while (after := post(small.http, "/v1/completions", {"prompt": "The sky is", "max_tokens": 4})[0]) != 200:
        assert time.monotonic() < deadline, after  # its prefill is aborted and its pages come back
        time.sleep(0.2)


def test_a_dead_worker_is_a_retryable_503_on_both_doors(small):
    """The supervisor starts a replacement at once, and it takes seconds to load (process, PyTorch, the
    model, Triton): requests sent meanwhile, one per door at the same moment with 2 s deadlines, wait for
    a worker until their deadline and then get a retryable UNAVAILABLE, never a client error and never a
    hang. (Asked one after the other with 3 s each, the second could meet the replacement on a fast host.)"""
    os.killpg(small.workers()["decode-0"]["pid"], signal.SIGKILL)
    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        http = pool.submit(_complete, small.http, "The sky is", 4, 2.0)
        grpc_error = pool.submit(_grpc_error, small.grpc, ensemble_inputs(grpcclient, "The sky is", 4, False), 2.0)
        status, body = http.result(timeout=30)
        error = grpc_error.result(timeout=30)
    assert status == 503 and body["error"]["code"] == "UNAVAILABLE", body
    assert error.status() == "StatusCode.UNAVAILABLE", error.message()
    assert time.monotonic() - t < 10
    with urllib.request.urlopen(small.http + "/metrics") as r:
        assert re.search(r'^tandem_request_failures_total\{model="[\w.-]+",status="UNAVAILABLE"\} [1-9]', r.read().decode(), re.M)
