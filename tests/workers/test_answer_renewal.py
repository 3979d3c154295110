"""An answer renewed across calls (engine/workers/relay.py, tandem/call_renewal.py): the decode worker ends
a call after `renew_after` tokens with a `renew` ticket and holds what follows until a Continue. The
real model in one process; each call's replies land in a ListSink as a Triton call's would."""

from __future__ import annotations

import pytest

from engine.tokenizer import ChatMessage
from engine.workers.relay import Relay
from tandem.call_renewal import ANSWER_RENEW_AFTER, Continue, answer_tokens
from tandem.sampling_params import SamplingParams
from tandem.status import Cancelled, LeaseLost
from tandem.wire import Open, Token
from tests.workers.test_handoff import ListSink, wait_until, worker_pair

PARAMS = SamplingParams(max_tokens=23, ignore_eos=True, logprobs=True, top_logprobs=2)


def prompt(engine, text="Tell me a long story about a lighthouse."):
    return engine.tokenizer.encode_chat([ChatMessage("user", text)])


def tokens_of(calls: list[ListSink]) -> list[Token]:
    return [r for sink in calls for r in sink.replies if isinstance(r, Token)]


def answer(decode, ids, rid, renew_after, wait_for_end=False) -> list[ListSink]:
    """One locally prefilled answer, read to its end over as many calls as the worker makes: each call's
    sink, in order. `wait_for_end`: before each Continue, let the request finish while it is parked."""
    calls = [ListSink()]
    decode.open(Open(rid, ids, PARAMS, local_prefill=True, renew_after=renew_after), calls[0])
    return follow(decode, rid, calls, wait_for_end)


def follow(decode, rid, calls: list[ListSink], wait_for_end=False) -> list[ListSink]:
    """Read on from the last of `calls` until a call ends without a `renew` ticket."""
    while True:
        assert calls[-1].finished.wait(60), "a call never ended"
        last = calls[-1].replies[-1] if calls[-1].replies else None
        if not isinstance(last, Token) or not last.renew:
            return calls
        assert calls[-1].error is None and last.finish_reason is None
        if wait_for_end:
            assert wait_until(lambda: rid not in decode.leases, 60)  # it ended while parked: its end is held
        calls.append(ListSink())
        decode.resume(Continue(rid, last.renew), calls[-1])


def test_an_answer_over_many_calls_is_the_answer_of_one(default_engine):
    ids = prompt(default_engine)
    with worker_pair(default_engine) as (_, decode):
        whole = answer(decode, ids, "one-call", 0)  # 0: the most, more than this answer's tokens
        assert len(whole) == 1
        at_once = answer(decode, ids, "renewed", 5)
        held = answer(decode, ids, "held", 5, wait_for_end=True)
        assert not decode.relays and not decode.leases
    expected = tokens_of(whole)
    assert len(expected) == PARAMS.max_tokens and expected[-1].finish_reason == "length"
    for calls, renewed_at in ((at_once, [4, 9, 14, 19]), (held, [4])):
        got = tokens_of(calls)
        assert [i for i, t in enumerate(got) if t.renew] == renewed_at
        assert [(t.token, t.logprob, t.top, t.finish_reason) for t in got] == \
            [(t.token, t.logprob, t.top, t.finish_reason) for t in expected]
    assert [len(tokens_of([c])) for c in at_once] == [5, 5, 5, 5, 3]
    assert [len(tokens_of([c])) for c in held] == [5, 18]  # all that came while parked, on the Continue


def test_a_continue_with_another_ticket_is_refused_and_the_right_one_goes_on(default_engine):
    ids = prompt(default_engine)
    with worker_pair(default_engine) as (_, decode):
        first = ListSink()
        decode.open(Open("r", ids, PARAMS, local_prefill=True, renew_after=3), first)
        assert first.finished.wait(60)
        ticket = first.replies[-1].renew
        for rid, wrong in (("r", "0" * 16), ("r", ""), ("other", ticket)):
            with pytest.raises(LeaseLost, match="no answer waits here"):
                decode.resume(Continue(rid, wrong), ListSink())
        rest = ListSink()
        decode.resume(Continue("r", ticket), rest)
        assert rest.error is None
        with pytest.raises(LeaseLost):  # a ticket serves once
            decode.resume(Continue("r", ticket), ListSink())
        calls = follow(decode, "r", [first, rest])
    assert len(tokens_of(calls)) == PARAMS.max_tokens


def test_a_parked_answer_nobody_continues_ends_and_frees_its_pages(default_engine):
    """Its orchestrator died after the renewal: no Triton call is left to be cancelled, so the worker's
    clock ends it (transfer_timeout_s), frees its pages (worker_pair checks) and forgets what it held."""
    ids = prompt(default_engine)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    with worker_pair(default_engine, transfer_timeout_s=0.5) as (_, decode):
        first = ListSink()
        decode.open(Open("gone", ids, params, local_prefill=True, renew_after=2), first)
        assert first.finished.wait(60) and first.replies[-1].renew
        assert wait_until(lambda: "gone" not in decode.leases and "gone" not in decode.relays, 30)
        assert decode.engine.allocator.num_used == 0
        with pytest.raises(LeaseLost):
            decode.resume(Continue("gone", first.replies[-1].renew), ListSink())


def test_a_failure_while_parked_reaches_the_continue():
    """A relay parked when its request fails (released, cancelled) hands the failure to the Continue."""
    now = [0.0]
    relay = Relay(ListSink(), 1, 10.0, lambda: now[0])
    relay.send(Token(7))
    assert relay.parked and relay.sink.done and relay.sink.replies[0].renew == relay.ticket
    relay.send(Token(8))
    relay.fail(Cancelled("released"))
    assert relay.done and not relay.cancelled()
    now[0] = 11.0
    assert relay.cancelled() and relay.expired()  # grace over: the worker gives it up
    now[0] = 5.0
    rest = ListSink()
    assert relay.resume(relay.ticket, rest)
    assert [r.token for r in rest.replies] == [8] and isinstance(rest.error, Cancelled) and not relay.parked


@pytest.mark.parametrize(("asked", "given"), [(0, ANSWER_RENEW_AFTER), (-1, ANSWER_RENEW_AFTER), (1, 1), (7, 7),
                                              (ANSWER_RENEW_AFTER + 1, ANSWER_RENEW_AFTER)])
def test_a_call_carries_at_most_the_constant(asked, given):
    assert answer_tokens(asked) == given
