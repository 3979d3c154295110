"""Background responses (`background: true` on /v1/responses) on a real 1P1D stack that keeps responses,
through the official `openai` SDK: the reply comes once the first token did, GET reads the response until
it ends as the foreground answer would; cancel and DELETE end a running answer and give its admission
place back; a running, cancelled or failed one cannot be continued; a stop cancels what still runs and
leaves nothing behind; what cannot be served in the background is a 400 naming `background`. Streamed
(`stream: true`), its events can be followed again from any sequence number, by a client that left or
by another, and a cancel ends them with an `error` event."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from frontdoor import response_background
from frontdoor.response_events import EventFeed
from frontdoor.response_store import Kept, ResponseStore
from tandem.status import Unavailable
from tests.conftest import start_serve, stop_serve
from tests.serve.hold import in_flight
from tests.serve.test_door_conformance import http

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
ASK = "Name a large city."
# 1500 CPU decode steps: still running when the test acts on it (vLLM's ignore_eos, sent as is)
LONG_BODY = {"input": "Count upwards from one, one number per line.", "max_output_tokens": 1500, "temperature": 0,
             "ignore_eos": True}
LONG = {k: v for k, v in LONG_BODY.items() if k != "ignore_eos"} | {"extra_body": {"ignore_eos": True}}


def _stack(built_engines, work, grace_s: float = 30.0):
    (work / "dep.yaml").write_text(yaml.safe_dump({"front_door": {"responses_kept": 8},
                                                   "health": {"drain_grace_s": grace_s}}))
    return start_serve(built_engines, work, "--config", str(work / "dep.yaml"))


@pytest.fixture(scope="module")
def kept(built_engines, tmp_path_factory):
    s = _stack(built_engines, tmp_path_factory.mktemp("serve-background"))
    yield s
    stop_serve(s)


@pytest.fixture(scope="module")
def client(kept):
    c = openai.OpenAI(base_url=kept.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _ended(client, rid: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while (got := client.responses.retrieve(rid)).status == "in_progress":
        assert time.monotonic() < deadline, f"{rid} still in progress after {timeout_s:.0f}s"
        time.sleep(0.1)
    return got


def _tokens_out(serve) -> float:
    """The front door's tandem_output_tokens_total: every token streamed to clients so far."""
    with urllib.request.urlopen(serve.http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tandem_output_tokens_total")


def _ended_early(serve, before: float, timeout_s: float = 120.0) -> None:
    """Wait until no request is admitted (the cancelled answer gave its place back), then check it ended
    early: fewer tokens than its 1500 (ignore_eos: it would have made every one) were made since `before`."""
    deadline = time.monotonic() + timeout_s
    while in_flight(serve) > 0:
        assert time.monotonic() < deadline, "a cancelled background answer still holds its admission place"
        time.sleep(0.05)
    assert 0 < _tokens_out(serve) - before < LONG_BODY["max_output_tokens"]  # its first token came before the reply


def test_a_background_response_is_read_back_as_the_foreground_answer(client):
    want = client.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0, store=False)
    started = client.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0, background=True)
    assert started.background and started.status in ("in_progress", "completed", "incomplete")
    got = _ended(client, started.id)
    assert got.id == started.id and got.background and got.status == want.status
    assert got.output_text == want.output_text and got.usage.output_tokens == want.usage.output_tokens
    follow = client.responses.create(model=MODEL, previous_response_id=got.id, input="And another?",
                                     max_output_tokens=8, temperature=0)
    assert follow.status in ("completed", "incomplete")  # an ended background response continues as any other


def test_cancel_ends_a_running_answer_and_gives_its_place_back(kept, client):
    before = _tokens_out(kept)
    started = client.responses.create(model=MODEL, background=True, **LONG)
    assert started.status == "in_progress" and started.output == []
    assert client.responses.retrieve(started.id).status == "in_progress"
    asked = list(client.responses.input_items.list(started.id))  # known while the answer is made
    assert [(i.role, i.content[0].text) for i in asked] == [("user", LONG["input"])]
    status, reply, _ = http(kept.http, "/v1/responses", {"model": MODEL, "input": "Go on.",
                                                         "previous_response_id": started.id})
    assert status == 400 and reply["error"]["param"] == "previous_response_id", reply  # not ended yet
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(started.id).status == "cancelled"
    _ended_early(kept, before)
    assert client.responses.cancel(started.id).status == "cancelled"  # cancelling again changes nothing
    status, reply, _ = http(kept.http, "/v1/responses", {"model": MODEL, "input": "Go on.",
                                                         "previous_response_id": started.id})
    assert status == 400 and "cancelled" in reply["error"]["message"], reply


def test_delete_ends_a_running_answer(kept, client):
    before = _tokens_out(kept)
    started = client.responses.create(model=MODEL, background=True, **LONG)
    assert in_flight(kept) >= 1
    client.responses.delete(started.id)
    _ended_early(kept, before)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(started.id)


def test_only_a_background_response_can_be_cancelled(kept, client):
    done = client.responses.create(model=MODEL, input=ASK, max_output_tokens=4, temperature=0)
    status, reply, _ = http(kept.http, f"/v1/responses/{done.id}/cancel", {})
    assert status == 400 and "background" in reply["error"]["message"], reply
    status, reply, _ = http(kept.http, "/v1/responses/resp_nothing/cancel", {})
    assert status == 404, reply


@pytest.mark.parametrize("extra", [{"store": False}, {"background": "yes"}])
def test_what_cannot_run_in_the_background_is_a_400_naming_it(kept, extra):
    status, reply, _ = http(kept.http, "/v1/responses", {"model": MODEL, "input": ASK, "background": True} | extra)
    assert status == 400 and reply["error"]["param"] == "background", reply


def test_a_refusal_before_the_first_token_is_the_posts_status(kept):
    status, reply, _ = http(kept.http, "/v1/responses", {"model": MODEL, "input": ASK, "background": True,
                                                         "max_output_tokens": 100000})  # past the context
    assert status == 400 and reply["error"]["param"] == "max_output_tokens", reply


def _dumps(events) -> list[dict]:
    return [e.model_dump() for e in events]


def test_a_streamed_background_response_can_be_followed_again_from_any_event(client):
    ask = {"model": MODEL, "input": ASK, "max_output_tokens": 24, "temperature": 0}
    want = client.responses.create(store=False, **ask)
    events = list(client.responses.create(background=True, stream=True, **ask))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{want.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.output_text
    rid = events[0].response.id
    done = events[-1].response
    assert done.background and done.id == rid and done.output_text == want.output_text
    assert client.responses.retrieve(rid).model_dump() == done.model_dump()  # GET reads what the stream ended with
    assert _dumps(client.responses.retrieve(rid, stream=True)) == _dumps(events)
    assert _dumps(client.responses.retrieve(rid, stream=True, starting_after=3)) == _dumps(events[4:])
    assert list(client.responses.retrieve(rid, stream=True, starting_after=len(events) + 5)) == []


def test_a_client_that_leaves_a_background_stream_leaves_the_answer_going(kept, client):
    """Leave after a few deltas; the answer still makes all its tokens (ignore_eos), and following again
    from the last event seen gives the rest: the two parts join to the whole text."""
    body = LONG | {"max_output_tokens": 60}
    stream = client.responses.create(background=True, stream=True, **body)
    seen = []
    for e in stream:
        seen.append(e)
        if sum(x.type == "response.output_text.delta" for x in seen) == 3:
            break
    stream.close()
    rid = seen[0].response.id
    got = _ended(client, rid)
    assert got.status == "incomplete" and got.usage.output_tokens == 60
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number))
    assert rest[0].sequence_number == seen[-1].sequence_number + 1 and rest[-1].type == "response.incomplete"
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert text == got.output_text and len(text) > 0


def test_a_cancelled_background_stream_ends_with_a_cancelled_error_event(kept, client):
    before = _tokens_out(kept)
    stream = client.responses.create(background=True, stream=True, **LONG)
    first = next(iter(stream))
    assert first.type == "response.created"
    assert client.responses.cancel(first.response.id).status == "cancelled"
    rest = list(stream)  # the stream goes on to its end: the events made before the cancel, then the error
    assert rest[-1].type == "error" and rest[-1].code == "CANCELLED", rest[-1]
    assert not any(e.type.startswith("response.completed") for e in rest)
    follow = list(client.responses.retrieve(first.response.id, stream=True, starting_after=first.sequence_number))
    assert _dumps(follow) == _dumps(rest)  # a reader who comes later reads the same end
    _ended_early(kept, before)


@pytest.mark.parametrize("query, param", [
    ("?stream=true", "stream"),  # a foreground response: no events kept
    ("?stream=yes", "stream"),
    ("?starting_after=2", "starting_after"),  # without stream
    ("?stream=true&starting_after=-1", "starting_after"),
    ("?stream=true&starting_after=two", "starting_after"),
])
def test_reading_events_that_are_not_kept_or_a_bad_query_is_a_400_naming_it(kept, client, query, param):
    done = client.responses.create(model=MODEL, input=ASK, max_output_tokens=4, temperature=0)
    status, reply, _ = http(kept.http, f"/v1/responses/{done.id}{query}", method="GET")
    assert status == 400 and reply["error"]["param"] == param, reply


def test_a_stop_cancels_the_background_answers_still_running(built_engines, tmp_path):
    s = _stack(built_engines, tmp_path, grace_s=0.5)
    try:
        status, started, _ = http(s.http, "/v1/responses", {"model": MODEL, "background": True, **LONG_BODY})
        assert status == 200 and started["status"] == "in_progress", started
    finally:
        stop_serve(s)  # exits 0 and leaves no process, page or shared memory segment behind
    assert f"background response {started['id']} ended cancelled" in s.log_tail(400)


def test_a_failed_streamed_background_answer_ends_its_feed_with_the_failed_response():
    """A worker fault after the first token that no resume could mend (caused here by the answer itself:
    on a real stack a dead worker's request resumes elsewhere): readers waiting on the feed, and those who
    come later, get `response.failed` with the error the GET shows."""
    async def run():
        store, feed = ResponseStore(4), EventFeed()
        in_progress = {"id": "resp_x", "status": "in_progress", "background": True}

        async def answer(on_delta):
            feed.add([{"type": "response.created", "sequence_number": 0}])
            on_delta(None)
            await asyncio.sleep(0.05)
            raise Unavailable("no decode worker is left")
        reply = await response_background.start(store, "resp_x", Kept("", (), in_progress, feed=feed), answer,
                                                lambda r: Kept("", (), r))
        assert reply == in_progress
        waiting = [e async for e in feed.follow()]  # follows from the first event until the end
        assert [e["type"] for e in waiting] == ["response.created", "response.failed"]
        assert [e["sequence_number"] for e in waiting] == [0, 1]
        got = store.get("resp_x", "").response
        assert got["status"] == "failed"
        assert got["error"] == {"code": "UNAVAILABLE", "message": "no decode worker is left"}
        assert waiting[-1]["response"] == got
        assert [e async for e in feed.follow(0)] == waiting[1:]
    asyncio.run(run())
