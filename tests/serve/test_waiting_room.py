"""The orchestrator's waiting room (control/waiting_room.py) on a real Fleet: after a change, a request
waiting behind one of a better priority holds off until that one leaves, and a request of equal
priority leaving wakes nobody (first come, first served: pages taken, not freed). The whole behaviour
on a real stack: tests/serve/test_priority.py."""

from __future__ import annotations

import asyncio
import time

from control.fleet import Fleet
from control.waiting_room import WaitingRoom


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
        with room.visit("urgent"):  # it ends however it ends: it leaves
            pass
        room.leave("low")
        later = asyncio.create_task(room.wait("later", 9, fleet.version, time.monotonic() + 5))
        await asyncio.sleep(0)
        fleet.poke()
        assert await later is True  # nobody better is waiting any more

    asyncio.run(main())
