"""Admission counts a request from the moment it passes the door: while it is tokenized it holds its
place, so a burst is refused at once instead of queueing for the tokenizer first (the real-stack
overload scenario is tests/faults/test_chaos.py)."""

from __future__ import annotations

import pytest

from control.admission import Admission
from tandem.status import InvalidArgument, ResourceExhausted


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


def test_one_callers_requests_are_limited_apart_from_the_others():
    a = Admission(max_in_flight=8, max_in_flight_per_key=2)
    mine = [a.admit(1, "tenant-a"), a.admit(1, "tenant-a")]
    with pytest.raises(ResourceExhausted, match="'tenant-a' has 2 requests in flight"):
        a.admit(1, "tenant-a")
    others = [a.admit(1, "tenant-b"), a.admit(1), a.admit(1)]  # another holder, and callers without keys
    mine.pop().close()
    mine.append(a.admit(1, "tenant-a"))  # its place is back
    for t in mine + others:
        t.close()
        t.close()  # twice: no double count
    assert (a.in_flight, dict(a.by_caller)) == (0, {})
    with pytest.raises(InvalidArgument, match="max_in_flight_per_key"):
        a.check_size(3, "tenant-a")
    a.check_size(3)  # without a key only the server's limit counts


def test_the_backlog_ahead_of_a_request_is_the_queued_prompts_of_its_priority_or_more_urgent():
    a = Admission(max_in_flight=8, max_queued_tokens=10)
    batch = [a.admit(4, priority=5), a.admit(4, priority=5)]
    with pytest.raises(ResourceExhausted, match=r"^8 prompt tokens are queued \(limit 10\)"):
        a.admit(4, priority=5)  # 8 ahead of it: all that is queued
    urgent = a.admit(6, priority=-5)  # none ahead: the less urgent backlog is served after it
    with pytest.raises(ResourceExhausted, match=r"^6 prompt tokens of priority 0 or more urgent are queued"):
        a.admit(5)
    a.admit(4).close()  # 6 + 4 fit
    urgent.first_token()  # its prompt is done: it is ahead of no one any more
    assert (a.queued_tokens, dict(a.queued)) == (8, {5: 8})
    for t in [urgent, *batch]:
        t.close()
    assert (a.in_flight, a.queued_tokens, dict(a.queued)) == (0, 0, {})
    first_come = Admission(max_in_flight=8, max_queued_tokens=10)  # fcfs: every priority 0, all of it ahead
    first_come.admit(8)
    with pytest.raises(ResourceExhausted, match=r"^8 prompt tokens are queued"):
        first_come.admit(3)
