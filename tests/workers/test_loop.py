"""The worker's threads hand a crash to their owner instead of dying quietly: a worker whose loop is gone
would keep heartbeating while its requests hang, one whose heartbeats are gone would look stalled."""

from __future__ import annotations

import threading

from engine.workers.decode_loop import ON_DUE, Due
from engine.workers.loop import Loop
from engine.workers.watchers import Watchers


def test_a_body_that_raises_is_reported_to_on_crash():
    calls, crashed = [], threading.Event()
    got: list[BaseException] = []

    def body() -> bool:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a bug in the loop")
        return True

    def on_crash(e: BaseException) -> None:
        got.append(e)
        crashed.set()

    loop = Loop(body, lambda: None, "test-loop").start(on_crash)
    assert crashed.wait(5)
    loop.thread.join(5)
    assert not loop.thread.is_alive() and len(calls) == 3
    assert isinstance(got[0], RuntimeError) and str(got[0]) == "a bug in the loop"


def test_a_loop_that_stops_normally_reports_nothing():
    got: list[BaseException] = []
    woken = threading.Event()

    def body() -> bool:
        woken.set()
        return False

    loop = Loop(body, lambda: None, "test-loop").start(got.append)
    assert woken.wait(5)
    loop.stop()
    assert not loop.thread.is_alive() and got == []


def test_every_decode_deadline_kind_has_its_handler():
    assert set(ON_DUE) == set(Due)
    assert all(callable(h) and h.__name__.startswith("_") for h in ON_DUE.values())


class _BrokenSink:
    """A watcher's sink whose send raises (a bug in the reply path)."""

    def send(self, body, final: bool = False) -> None:
        raise RuntimeError("a bug in a reply")

    def fail(self, error: BaseException) -> None:
        pass

    def cancelled(self) -> bool:
        return False


def test_a_heartbeat_that_raises_is_reported_to_on_crash():
    got: list[BaseException] = []
    crashed = threading.Event()
    watchers = Watchers(lambda: "stats")
    watchers.on_crash = lambda e: got.append(e) or crashed.set()
    watchers.add(_BrokenSink(), heartbeat_s=0.05)  # its first push goes at once, on the heartbeat thread
    assert crashed.wait(5)
    watchers._thread.join(5)
    assert not watchers._thread.is_alive() and str(got[0]) == "a bug in a reply"
