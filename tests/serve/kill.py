"""Kill the worker serving a stream once the client has a few of its tokens, without timing: `post`
calls back on each streamed event, and the callback kills at the n-th (a fixed sleep stopped meaning
"mid-stream" once the engine got fast enough to finish 80 tokens first)."""

from __future__ import annotations

import os
import re
import signal
import urllib.request


def worker_requests(http: str) -> dict[str, float]:
    """tandem_worker_requests_total per worker, from the front door's /metrics."""
    with urllib.request.urlopen(http + "/metrics") as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^tandem_worker_requests_total\{role="\w+",worker="([\w-]+)"\} ([\d.e+]+)', text, re.M)}


class KillServing:
    """An `on_event` callback for tests.serve.clients.post: at the `at`-th streamed event it SIGKILLs the
    process group of the `role` worker (name prefix) that took a request since this object was made.
    `killed` names it afterwards (None: the stream ended before the `at`-th event)."""

    def __init__(self, serve, role: str, at: int = 5):
        self.serve, self.role, self.at = serve, role, at
        self.before = worker_requests(serve.http)
        self.killed: str | None = None

    def __call__(self, events: int) -> None:
        if events != self.at:
            return
        now = worker_requests(self.serve.http)
        self.killed = next(w for w in sorted(now) if w.startswith(self.role) and now[w] > self.before.get(w, 0))
        os.killpg(self.serve.workers()[self.killed]["pid"], signal.SIGKILL)
