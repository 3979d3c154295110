"""Admission counts a request from the moment it passes the door: while it is tokenized it holds its
place, so a burst is refused at once instead of queueing for the tokenizer first (the real-stack
overload scenario is tests/faults/test_chaos.py)."""

from __future__ import annotations

import pytest

from control.admission import Admission
from tandem.status import ResourceExhausted


def test_a_request_being_prepared_holds_its_place_until_it_is_admitted():
    a = Admission(max_in_flight=2)
    with a.prepare():
        with a.prepare():
            with pytest.raises(ResourceExhausted, match=r"2 requests in flight \(limit 2\)"):
                a.check()  # two are being tokenized: a third is refused before any work
        first = a.admit(5)  # the second is prepared: its place passes to its ticket
        with pytest.raises(ResourceExhausted):
            with a.prepare():
                pass
    second = a.admit(5)
    assert (a.in_flight, a.preparing, a.queued_tokens) == (2, 0, 10)
    with pytest.raises(ResourceExhausted):
        a.check()
    first.close()
    a.check()  # a place is free again
    second.close()
    assert (a.in_flight, a.preparing, a.queued_tokens) == (0, 0, 0)


def test_a_preparation_that_fails_gives_its_place_back():
    a = Admission(max_in_flight=1)
    with pytest.raises(ValueError):
        with a.prepare():
            raise ValueError("a prompt over the limit, say")
    assert a.preparing == 0
    a.admit(3).close()
