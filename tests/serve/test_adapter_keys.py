"""The orchestrator's table of LoRA adapters (control/adapters.py) without workers: the keys requests
carry, a request's hold across an unload, loads of the same name keyed apart, and the limit on how many
are held (a load in place fits at it), and the release at stop (a request still ending after it changes
nothing). tests/serve/test_lora_replicas.py shows the release on workers."""

from __future__ import annotations

import asyncio

import pytest

from control.adapters import Adapters
from control.fleet import Fleet
from tandem.status import InvalidArgument, NotFound, ResourceExhausted


def test_keys_holds_and_unloads():
    async def run():
        table = Adapters({"start": "/adapters/start"})
        assert table.key_of("start") == "start" and table.key_of("other") == "" and table.key_of(None) == ""
        await table.load("sql", "/adapters/sql-1")
        first = table.key_of("sql")
        assert first.startswith("sql#") and list(table) == ["start", "sql"]
        with pytest.raises(InvalidArgument, match="already loaded"):
            await table.load("sql", "/adapters/sql-2")
        with table.hold(first):  # a request named it, then it was loaded again in place
            await table.load("sql", "/adapters/sql-2", replace=True)
            second = table.key_of("sql")
            assert second not in ("", first)  # a new key: its cached pages are its own
            assert table.modules() == {"start": "/adapters/start", first: "/adapters/sql-1",
                                       second: "/adapters/sql-2"}  # the old one stays while held
        await asyncio.sleep(0)
        assert first not in table.modules()  # dropped once its last request ended
        with pytest.raises(NotFound, match="'sql' was unloaded"):
            with table.hold(first):
                pass
        await table.unload("sql")
        assert "sql" not in table and table.key_of("sql") == ""
        with pytest.raises(NotFound, match="is not loaded"):
            await table.unload("sql")

    asyncio.run(run())


def test_a_load_in_place_fits_at_the_limit():
    async def run():
        table = Adapters({"start": "/adapters/start"}, max_adapters=2)
        await table.load("sql", "/adapters/sql-1")
        with pytest.raises(ResourceExhausted, match="holds 2 LoRA adapters.*max_adapters"):
            await table.load("other", "/adapters/other")
        with table.hold(table.key_of("sql")):  # sql-1 stays on the workers while its request runs
            await table.load("sql", "/adapters/sql-2", replace=True)
            assert len(table.modules()) == 3  # one over, while sql-1 finishes
            with pytest.raises(ResourceExhausted, match="holds 2 LoRA adapters"):  # never two over
                await table.load("sql", "/adapters/sql-3", replace=True)
        await table.load("sql", "/adapters/sql-3", replace=True)
        assert table.modules() == {"start": "/adapters/start", table.key_of("sql"): "/adapters/sql-3"}

    asyncio.run(run())


def test_a_request_ending_after_the_release_changes_nothing():
    async def run():
        table = Adapters({"start": "/adapters/start"})
        table.attach(Fleet())  # no workers: every send reaches none
        await table.load("sql", "/adapters/sql")
        with table.hold(table.key_of("sql")):
            await table.unload("sql")  # retired, held by the request
            await table.release()
        assert table.modules() == {} and list(table) == [] and not table._tasks

    asyncio.run(run())
