"""The worker loop thread: it hands a crash to its owner instead of dying quietly (a worker whose loop
is gone would keep heartbeating while its requests hang)."""

from __future__ import annotations

import threading

from engine.workers.decode_loop import ON_DUE, Due
from engine.workers.loop import Loop


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
