"""FrontDoor.answer_all's ordering rules, with each answer's stream scripted.

The real-stack tests (test_openai_choices.py) show several answers served exactly. What they cannot
show is an order of events that a real stack produces only by chance: one answer refused after
another already has its first token (the tokenizer holds the GIL, so which of the two the event loop
sees first is luck). Here each answer is a script of awaited events, so the order is fixed and the
rule is checked: nothing is yielded before every answer is admitted, a failure ends every answer, and
a consumer that leaves early leaves no answer running.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from control.admission import Admission
from control.requests import GenerationRequest
from frontdoor.core import Delta, FrontDoor
from tandem.status import InvalidArgument, ResourceExhausted


def _door(scripts: dict[str, list]) -> tuple[FrontDoor, dict[str, str]]:
    """A front door whose answer to request `r` plays scripts[r.request_id]: ("admit",), ("delta", text),
    ("wait", event), or ("fail", error). `ended[id]` says how each answer ended."""
    door, ended = FrontDoor(SimpleNamespace(service=SimpleNamespace(admission=Admission()))), {}

    async def answer(req: GenerationRequest, on_admitted=None):
        try:
            for step in scripts[req.request_id]:
                if step[0] == "admit":
                    on_admitted()
                elif step[0] == "delta":
                    yield Delta(step[1], 1, None, step[2] if len(step) > 2 else None)
                elif step[0] == "wait":
                    await step[1].wait()
                else:
                    raise step[1]
            ended[req.request_id] = "done"
        except BaseException as e:
            ended[req.request_id] = type(e).__name__
            raise

    door.answer = answer
    return door, ended


def _reqs(*ids: str) -> list[GenerationRequest]:
    return [GenerationRequest(request_id=i, prompt="x") for i in ids]


async def _take(door: FrontDoor, reqs, got: list | None = None) -> list[tuple[int, str]]:
    """(answer index, text) of every delta, appended to `got` as they come."""
    got = [] if got is None else got
    async with contextlib.aclosing(door.answer_all(reqs)) as deltas:
        async for d in deltas:
            got.append((d.index, d.text))
    return got


def test_a_refusal_after_another_answers_first_token_is_raised_before_anything_is_yielded():
    async def main():
        late = asyncio.Event()
        door, ended = _door({"a": [("admit",), ("delta", "first"), ("wait", asyncio.Event())],
                             "b": [("wait", late), ("fail", ResourceExhausted("full"))]})
        got = []
        task = asyncio.create_task(_take(door, _reqs("a", "b"), got))
        await asyncio.sleep(0.05)  # answer a is admitted and has its first delta; b is not admitted yet
        assert not task.done() and got == []
        late.set()
        with pytest.raises(ResourceExhausted):
            await task
        assert got == [] and ended == {"a": "CancelledError", "b": "ResourceExhausted"}

    asyncio.run(main())


def test_deltas_held_until_every_answer_is_admitted_come_in_order_and_marked_with_their_answer():
    async def main():
        late = asyncio.Event()
        door, ended = _door({"a": [("admit",), ("delta", "a1"), ("delta", "a2"), ("wait", late), ("delta", "a3", "stop")],
                             "b": [("wait", late), ("admit",), ("delta", "b1", "length")]})
        task = asyncio.create_task(_take(door, _reqs("a", "b")))
        await asyncio.sleep(0.05)
        late.set()
        got = await task
        assert got[:2] == [(0, "a1"), (0, "a2")] and sorted(got[2:]) == [(0, "a3"), (1, "b1")]
        assert ended == {"a": "done", "b": "done"}

    asyncio.run(main())


def test_a_failure_after_the_stream_began_ends_every_answer():
    async def main():
        door, ended = _door({"a": [("admit",), ("delta", "a1"), ("wait", asyncio.Event())],
                             "b": [("admit",), ("delta", "b1"), ("fail", InvalidArgument("bad"))]})
        with pytest.raises(InvalidArgument):
            await _take(door, _reqs("a", "b"))
        assert ended == {"a": "CancelledError", "b": "InvalidArgument"}

    asyncio.run(main())


def test_a_consumer_that_leaves_early_cancels_every_answer_before_it_returns():
    async def main():
        never = asyncio.Event()
        door, ended = _door({i: [("admit",), ("delta", i), ("wait", never)] for i in "abc"})
        async with contextlib.aclosing(door.answer_all(_reqs("a", "b", "c"))) as deltas:
            async for _ in deltas:
                break
        assert ended == {i: "CancelledError" for i in "abc"}

    asyncio.run(main())
