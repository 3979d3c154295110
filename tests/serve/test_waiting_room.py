"""The orchestrator's waiting room (control/waiting_room.py) on a real Fleet: after a change, a request
waiting behind one of a better priority holds off until that one leaves, and a request of equal
priority leaving wakes nobody (first come, first served: pages taken, not freed); a request refused for
pages preempts the least urgent of the worse ones running there, one at a time. The whole behaviour on a
real stack: tests/serve/test_priority.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from control.fleet import Fleet
from control.serving_path import _step
from control.waiting_room import Preempted, WaitingRoom


def test_a_worse_priority_holds_off_until_the_better_one_leaves():
    async def main():
        fleet = Fleet()
        room = WaitingRoom(fleet)
        deadline = time.monotonic() + 30
        urgent = asyncio.create_task(room.wait("urgent", -5, fleet.version, deadline))
        low = asyncio.create_task(room.wait("low", 5, fleet.version, deadline))
        await asyncio.sleep(0)
        fleet.poke()  # pages freed
        assert await urgent is True
        await asyncio.sleep(0.05)
        assert not low.done()  # the urgent one is still waiting (trying): the low one holds off
        room.leave("urgent")  # placed
        assert await asyncio.wait_for(low, 5) is True
        room.leave("low")

    asyncio.run(main())


def test_equal_priorities_try_together_and_a_leave_wakes_nobody():
    async def main():
        fleet = Fleet()
        room = WaitingRoom(fleet)
        deadline = time.monotonic() + 30
        waits = [asyncio.create_task(room.wait(f"r{i}", 0, fleet.version, deadline)) for i in range(3)]
        await asyncio.sleep(0)
        fleet.poke()
        assert await asyncio.gather(*waits) == [True, True, True]
        version = fleet.version
        room.leave("r0")
        room.leave("r0")  # idempotent
        await asyncio.sleep(0.05)
        assert fleet.version == version

    asyncio.run(main())


def test_holding_off_past_the_deadline_gives_up():
    async def main():
        fleet = Fleet()
        room = WaitingRoom(fleet)
        urgent = asyncio.create_task(room.wait("urgent", -1, fleet.version, time.monotonic() + 30))
        low = asyncio.create_task(room.wait("low", 1, fleet.version, time.monotonic() + 0.3))
        await asyncio.sleep(0)
        fleet.poke()
        assert await urgent is True
        assert await low is False  # the urgent one never left
        with room.visit("urgent", -1):  # it ends however it ends: it leaves
            pass
        room.leave("low")
        later = asyncio.create_task(room.wait("later", 9, fleet.version, time.monotonic() + 5))
        await asyncio.sleep(0)
        fleet.poke()
        assert await later is True  # nobody better is waiting any more

    asyncio.run(main())


def test_room_is_made_by_preempting_the_least_urgent_opened_there_else_anywhere_one_at_a_time():
    room = WaitingRoom(Fleet())
    with room.visit("a", 5) as a, room.visit("b", 5) as b, room.visit("c", 9) as c, room.visit("d", 0) as d, \
            room.visit("between", 7) as between, room.visit("prefilling", 20) as prefilling:
        for seat, worker in ((a, "decode-0"), (b, "decode-0"), (c, "decode-1"), (d, "decode-0")):
            seat.take(worker, lambda: True)
        # between attempts it holds no pages; nor before its attempt opens on its worker (a pull prefilling)
        prefilling.take("decode-0", lambda: False)
        assert not room.make_room(9, "decode-0")  # nobody anywhere is worse than 9 (an equal is not worse)
        assert room.make_room(5, "decode-0") and c.preempted  # nobody worse there: the least urgent elsewhere
        assert not (a.preempted or b.preempted or d.preempted)
        assert room.make_room(-1, "decode-0") and b.preempted and not a.preempted  # the later of the two 5s
        assert room.make_room(-1, "decode-0") and not a.preempted  # b is still giving its pages back
        b.vacate()
        assert room.make_room(-1, "decode-0") and a.preempted
        a.vacate()
        assert room.make_room(-1, "decode-0") and d.preempted and not between.preempted
        d.vacate()
        assert room.make_room(-1, "decode-0")  # nobody left there, and c is still giving its pages back
        c.vacate()
        assert not room.make_room(-1, None) and not prefilling.preempted
        prefilling.take("decode-0", lambda: True)  # it opened there: the least urgent of all
        assert room.make_room(-1, "decode-0") and prefilling.preempted


def test_a_preempted_step_ends_as_preempted_and_a_clients_cancel_stays_a_cancel():
    class Unanswered:  # an attempt whose worker has not sent its next token yet (a fault-free stand-in)
        async def next(self):
            await asyncio.Event().wait()

    async def main():
        room = WaitingRoom(Fleet())
        with room.visit("low", 5) as seat:
            for client_leaves in (False, True):
                seat.take("decode-0", lambda: True)
                step = asyncio.create_task(_step(Unanswered(), time.monotonic() + 30, seat))
                await asyncio.sleep(0.01)
                assert room.make_room(0, "decode-0")
                if client_leaves:
                    step.cancel()  # at the same moment: the request ends, it is not resumed
                with pytest.raises(asyncio.CancelledError if client_leaves else Preempted):
                    await step
                seat.vacate()
            seat.take("decode-0", lambda: True)
            room.make_room(0, "decode-0")  # preempted while its token was on its way out: the next step says so
            with pytest.raises(Preempted):
                await _step(Unanswered(), time.monotonic() + 30, seat)

    asyncio.run(main())


def test_an_attempt_after_a_preemption_has_an_id_of_its_own():
    """A preempted attempt may still be open on its worker when the request tries again there (its
    Release, or the end of its Open call, is on its way): the next Open must not reuse its id, or that
    worker refuses it as already open, a server conflict the client saw as a 400. The serving path's own
    run loop with scripted attempts (the race cannot be caused on a stack at will; a preemption storm on
    one is tests/serve/test_preemption_storm.py)."""
    from types import SimpleNamespace

    from control.fleet import WorkerState
    from control.handoff import Attempt
    from control.router import ROUTERS
    from control.serving_path import ServingPath
    from frontdoor.door_metrics import Metrics
    from tandem.wire import Token

    ids: list[str] = []
    fleet = Fleet()

    class PreemptedOnce(Attempt):
        async def next(self):
            if len(ids) == 1:
                asyncio.get_running_loop().call_soon(fleet.poke)  # its pages came back
                raise Preempted()
            if self.finished:
                return None
            self.finished = True
            return Token(1, finish_reason="length")

    class Scripted(ServingPath):
        roles = ("decode",)

        def attempt(self, prep, sent, avoid, request_id, span=None):
            ids.append(request_id)
            return PreemptedOnce(WorkerState("decode-0", "decode", "127.0.0.1:1", None), request_id, span)

    async def main():
        path = Scripted(fleet, ROUTERS["least-loaded"](), 16, Metrics("disaggregated"))
        prep = SimpleNamespace(request=SimpleNamespace(request_id="r"), params=SimpleNamespace(lora="", priority=5))
        return [t.token async for t in path.run(prep, time.monotonic() + 30)]

    assert asyncio.run(main()) == [1]
    assert len(ids) == 2 and ids[0] != ids[1], ids  # neither had sent a token
