"""A Watch call ends after its pushes (Triton keeps every response of a request until it ends), and its
owner leaves and comes back as it would with a watch that broke and was begun again."""

from __future__ import annotations

import pytest

from engine.workers.watchers import Watchers
from tandem.call_renewal import WATCH_RENEW_AFTER, watch_pushes
from tandem.roles import Role
from tandem.wire import WorkerStats
from tests.workers.test_handoff import ListSink


class RecordingSink(ListSink):
    """A ListSink that also writes what it receives into a shared log of events."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def send(self, body, final=False):
        self.events.append(("final" if final else "push", body.renew))
        super().send(body, final)


def test_a_call_ends_after_its_pushes_with_a_renew_reply_and_its_owner_leaves_first():
    events = []
    watchers = Watchers(lambda: WorkerStats(role=Role.PREFILL))
    watchers.on_owner_gone = lambda owner: events.append(("gone", owner))
    watchers.on_owner_back = lambda owner: events.append(("back", owner))
    try:
        sink = RecordingSink(events)
        watchers.add(sink, 60.0, "o1", renew_after=3)
        for _ in range(4):  # the fourth finds no watcher
            watchers.push(force=True)
        # the owner's leaving is said before the final reply, so the watch its orchestrator begins on
        # reading that reply always comes after it (and ends the LoRA set's grace)
        assert events == [("back", "o1"), ("push", False), ("push", False), ("gone", "o1"), ("final", True)]
        assert sink.done and len(sink.replies) == 3

        again = RecordingSink(events)
        watchers.add(again, 60.0, "o1", renew_after=3)
        watchers.push(force=True)
        assert events[-2:] == [("back", "o1"), ("push", False)] and not again.done
    finally:
        watchers.close()


def test_a_renewal_with_another_watch_of_its_owner_left_is_no_departure():
    gone = []
    watchers = Watchers(lambda: WorkerStats(role=Role.DECODE))
    watchers.on_owner_gone = gone.append
    try:
        short, long = ListSink(), ListSink()
        watchers.add(short, 60.0, "o1", renew_after=1)
        watchers.add(long, 60.0, "o1")
        watchers.push(force=True)
        assert short.done and short.replies[-1].renew
        assert not long.done and not long.replies[-1].renew
        assert gone == []
    finally:
        watchers.close()


@pytest.mark.parametrize("asked, given", [(1, 1), (3, 3), (WATCH_RENEW_AFTER, WATCH_RENEW_AFTER),
                                          (WATCH_RENEW_AFTER + 1, WATCH_RENEW_AFTER), (0, WATCH_RENEW_AFTER),
                                          (-5, WATCH_RENEW_AFTER)])
def test_a_caller_may_ask_for_fewer_pushes_per_call_never_more(asked, given):
    assert watch_pushes(asked) == given
