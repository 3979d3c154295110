"""The supervisor's decisions on a real `tandem serve` (1 prefill + 1 decode worker, default model):
which worker it replaces, and how often."""

from __future__ import annotations

import os
import re
import signal
import time

import yaml

from clients.chaos.faults import LocalTarget
from tests.conftest import start_serve, stop_serve, worker_events

STALL_RESTART_S = 30.0


def wait_for_event(s, pattern: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(re.search(pattern, e) for e in worker_events(s)):
        assert time.monotonic() < deadline, (pattern, worker_events(s))
        time.sleep(0.1)


def test_a_stalled_worker_that_then_dies_is_replaced_once(built_engines, tmp_path):
    """The stall's timer is for the stalled process only: when that process dies and its replacement is
    ready before the timer ends, the timer must not take the new worker for the silent one and kill it."""
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump({"health": {"stall_restart_s": STALL_RESTART_S}}))
    s = start_serve(built_engines, tmp_path / "serve", "--config", str(path))
    try:
        target = LocalTarget(s.workdir)
        pid = target.stop("decode-0")
        wait_for_event(s, r"worker decode-0 .* left routing: .*stalled", 30)
        timer_ends = time.monotonic() + STALL_RESTART_S
        os.killpg(pid, signal.SIGKILL)  # dies while stopped: the supervisor replaces it at once
        wait_for_event(s, r"worker decode-0 is back at", 120)
        assert time.monotonic() < timer_ends, "the replacement took longer than the stall's timer: nothing tested"
        replacement = target.pid("decode-0")
        time.sleep(timer_ends + 3.0 - time.monotonic())
        events = worker_events(s)
        assert target.pid("decode-0") == replacement, events
        assert sum("is back at" in e for e in events) == 1 and not any("silent for" in e for e in events), events
    finally:
        stop_serve(s)
