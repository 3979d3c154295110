"""Hold a request in flight for as long as a test needs, without timing: the prefill worker's processes
(its Triton server and stubs, one process group) are stopped with SIGSTOP, so a request sent meanwhile
is admitted and waits for its first token until they continue (SIGCONT)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.serve.clients import post


def in_flight(serve) -> float:
    """The front door's tandem_requests_in_flight (admitted requests), read from its /metrics."""
    with urllib.request.urlopen(serve.http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tandem_requests_in_flight")


@contextlib.contextmanager
def held(serve, headers: dict | None = None, worker: str = "prefill-0", timeout_s: float = 60.0):
    """Inside the block one completion request is admitted and waiting (its prefill worker paused);
    yields the future of its (status, body), which completes after the block (the worker continues)."""
    pgid = serve.workers()[worker]["pid"]
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        os.killpg(pgid, signal.SIGSTOP)
        try:
            future = pool.submit(post, serve.http, "/v1/completions", body, headers=headers)
            deadline = time.monotonic() + timeout_s
            while in_flight(serve) < 1:
                if future.done() or time.monotonic() > deadline:
                    why = future.result() if future.done() else f"not within {timeout_s:.0f}s"
                    raise AssertionError(f"the held request was not admitted: {why}")
                time.sleep(0.05)
            yield future
        finally:
            os.killpg(pgid, signal.SIGCONT)
