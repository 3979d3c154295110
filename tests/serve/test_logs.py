"""Log lines: text or one JSON object per line, each naming the request it was written for, also from
tasks the request's handler started; the access line's fields."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from tandem.logs import log_access, setup_logging
from tandem.request_context import begin, current_id, end, is_valid_id, note_tokens


@pytest.fixture
def root_restored():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_lines_name_the_request_in_every_task_it_started(capsys, root_restored):
    setup_logging("json")
    log = logging.getLogger("tandem.test")

    async def request(rid: str):
        record, token = begin(rid)
        try:
            log.info("arrived")
            await asyncio.create_task(child())  # a task copies the context it was started in
            note_tokens(7, 3)
            log_access("POST", "/v1/completions", 200, time.perf_counter(), record, "127.0.0.1")
        finally:
            end(token)

    async def child():
        await asyncio.sleep(0)
        log.warning("deep inside")

    async def main():
        await asyncio.gather(request("first-1"), request("second-2"))
        log.info("between requests")

    asyncio.run(main())
    lines = [json.loads(ln) for ln in capsys.readouterr().err.splitlines()]
    assert len(lines) == 7
    for rid in ("first-1", "second-2"):
        mine = [ln for ln in lines if ln["request_id"] == rid]
        assert [ln["message"] for ln in mine][:2] == ["arrived", "deep inside"]
        (access,) = [ln for ln in mine if ln["logger"] == "tandem.access"]
        assert access["route"] == "/v1/completions" and access["status"] == 200 and access["method"] == "POST"
        assert access["prompt_tokens"] == 7 and access["completion_tokens"] == 3 and access["duration_ms"] >= 0
    assert lines[-1] == {**lines[-1], "request_id": "", "message": "between requests", "level": "INFO"}
    assert current_id() == ""


def test_text_lines_carry_the_id_and_a_bad_format_is_refused(capsys, root_restored):
    setup_logging("text")
    _, token = begin("abc-123")
    logging.getLogger("tandem.test").warning("hello")
    end(token)
    logging.getLogger("tandem.test").warning("outside")
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("WARNING tandem.test [req=abc-123]: hello")
    assert err[1].endswith("WARNING tandem.test: outside")
    with pytest.raises(ValueError, match="text, json"):
        setup_logging("xml")


def test_client_ids_that_could_forge_log_lines_are_not_valid():
    assert is_valid_id("req-42_a.b:c/d@e+f=g")
    for bad in ("", "two words", "line\nbreak", "x" * 129, "quote\"d", "tab\tbed"):
        assert not is_valid_id(bad)
