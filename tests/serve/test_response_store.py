"""Kept responses (front_door.responses_kept) on a real stack with two API keys: a follow-up
(`previous_response_id`) is answered as the whole conversation would be on the chat door, tool calls
and their outputs included, whole and streamed; GET and DELETE /v1/responses/{id}; each response is
its caller's alone; its input items are listed a page at a time; the oldest is dropped past the limit;
`store: false` keeps nothing. And the store itself, without a server: bounded by count and by bytes
(the newest always kept)."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml

from frontdoor.response_events import EventFeed
from frontdoor.response_store import Kept, ResponseStore
from tandem.status import InvalidArgument, NotFound
from tests.conftest import start_serve, stop_serve
from tests.serve.test_tool_calls import ASK as TOOL_ASK
from tests.serve.test_tool_calls import TIME, WEATHER

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
KEY_A, KEY_B = "holder-a-key-0123456789", "holder-b-key-0123456789"
TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
KEPT = 3


@pytest.fixture(scope="module")
def kept(built_engines, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-kept-responses")
    (work / "keys").write_text(f"{KEY_A} holder-a\n{KEY_B} holder-b\n")
    (work / "dep.yaml").write_text(yaml.safe_dump({"front_door": {"api_key_file": str(work / "keys"),
                                                                  "responses_kept": KEPT}}))
    s = start_serve(built_engines, work, "--config", str(work / "dep.yaml"))
    yield s
    stop_serve(s)


@pytest.fixture(scope="module")
def clients(kept):
    made = [openai.OpenAI(base_url=kept.http + "/v1", api_key=k, max_retries=0, timeout=120) for k in (KEY_A, KEY_B)]
    yield made
    for c in made:
        c.close()


def test_a_follow_up_is_answered_as_the_whole_conversation_on_the_chat_door(clients):
    a, _ = clients
    first = a.responses.create(model=MODEL, input="My name is Ada. Greet me.", instructions="Be brief.",
                               max_output_tokens=12, temperature=0)
    assert first.store
    follow = a.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                max_output_tokens=12, temperature=0)
    chat = a.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[  # instructions do not carry
        {"role": "user", "content": "My name is Ada. Greet me."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert follow.output_text == chat.choices[0].message.content and follow.previous_response_id == first.id
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    with a.responses.stream(model=MODEL, previous_response_id=follow.id, input="Say it again.",
                            max_output_tokens=8, temperature=0) as stream:
        streamed = list(stream)[-1].response  # completed or (cut at 8 tokens) incomplete: kept either way
    again = a.responses.create(model=MODEL, previous_response_id=streamed.id, input="Once more.", max_output_tokens=8,
                               temperature=0)  # the streamed one was kept too
    chat = a.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada. Greet me."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}, {"role": "assistant", "content": follow.output_text},
        {"role": "user", "content": "Say it again."}, {"role": "assistant", "content": streamed.output_text},
        {"role": "user", "content": "Once more."}])
    assert again.output_text == chat.choices[0].message.content


def test_a_call_and_its_output_continue_the_conversation(clients):
    a, _ = clients
    called = a.responses.create(model=MODEL, input=TOOL_ASK, tools=TOOLS, tool_choice="required",
                                max_output_tokens=120, temperature=0, parallel_tool_calls=False)
    call = called.output[0]
    assert call.type == "function_call" and len(called.output) == 1
    follow = a.responses.create(model=MODEL, previous_response_id=called.id, tools=TOOLS, tool_choice="none",
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": "18 degrees, sunny"}], max_output_tokens=16, temperature=0)
    chat = a.chat.completions.create(model=MODEL, tools=[WEATHER, TIME], tool_choice="none", max_tokens=16,
                                     temperature=0, messages=TOOL_ASK + [
                                         {"role": "assistant", "content": None, "tool_calls": [{
                                             "id": call.call_id, "type": "function",
                                             "function": {"name": call.name, "arguments": call.arguments}}]},
                                         {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"}])
    assert follow.output_text == chat.choices[0].message.content and follow.output_text
    items = list(a.responses.input_items.list(follow.id, order="asc"))
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert (items[0].role, items[0].content[0].type, items[0].content[0].text) == ("user", "input_text",
                                                                                  TOOL_ASK[0]["content"])
    assert (items[1].id, items[1].call_id, items[1].name, items[1].arguments) == (call.id, call.call_id, call.name,
                                                                                  call.arguments)
    assert (items[2].call_id, items[2].output) == (call.call_id, "18 degrees, sunny") and items[2].id.startswith("fco_")


def test_a_responses_input_items_are_the_conversation_it_was_asked_a_page_at_a_time(clients):
    """GET /v1/responses/{id}/input_items (the SDK's input_items.list): the earlier response's input and
    output, then its own input (instructions aside), newest first by default; the SDK's pages (limit 1)
    follow has_more and after to the same list; another key's is a 404."""
    a, b = clients
    first = a.responses.create(model=MODEL, input="My name is Ada. Greet me.", instructions="Be brief.",
                               max_output_tokens=6, temperature=0)
    follow = a.responses.create(model=MODEL, previous_response_id=first.id, max_output_tokens=6, temperature=0,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": "My name?"}]}])
    items = list(a.responses.input_items.list(follow.id, order="asc"))
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in items] == [
        ("message", "user", "input_text", "My name is Ada. Greet me."),
        ("message", "assistant", "output_text", first.output_text), ("message", "user", "input_text", "My name?")]
    assert items[1].id == first.output[0].id
    assert [i.id for i in a.responses.input_items.list(first.id)] == [items[0].id]  # ids are kept, not remade
    newest_first = list(a.responses.input_items.list(follow.id))
    assert [i.id for i in newest_first] == [i.id for i in reversed(items)]
    assert [i.id for i in a.responses.input_items.list(follow.id, limit=1)] == [i.id for i in newest_first]
    page = a.responses.input_items.list(follow.id, limit=2, order="asc", after=items[0].id)
    assert ([i.id for i in page.data], page.has_more) == ([i.id for i in items[1:]], False)
    with pytest.raises(openai.NotFoundError):
        b.responses.input_items.list(follow.id)


def test_an_item_reference_stands_for_the_kept_item_it_names(clients):
    """A client that sends the conversation again naming earlier items by id (item_reference) is answered
    as with the items themselves; an id of another key's response, or of none, is a 400 naming input."""
    a, b = clients
    first = a.responses.create(model=MODEL, input="My name is Ada. Greet me.", max_output_tokens=6, temperature=0)
    [asked] = list(a.responses.input_items.list(first.id))
    again = [{"type": "item_reference", "id": asked.id}, {"type": "item_reference", "id": first.output[0].id},
             {"role": "user", "content": "What is my name?"}]
    by_reference = a.responses.create(model=MODEL, input=again, max_output_tokens=6, temperature=0)
    by_previous = a.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=6, temperature=0)
    assert by_reference.output_text == by_previous.output_text
    assert by_reference.usage.input_tokens == by_previous.usage.input_tokens
    items = list(a.responses.input_items.list(by_reference.id, order="asc"))
    assert [i.id for i in items[:2]] == [asked.id, first.output[0].id]  # the items themselves, with their ids
    for client, rid in ((b, asked.id), (a, "msg_nothing")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": rid}], max_output_tokens=2)
        assert e.value.body["param"] == "input" and rid in e.value.body["message"], e.value.body


@pytest.mark.parametrize("query, param", [({"order": "sideways"}, "order"), ({"limit": "0"}, "limit"),
                                          ({"limit": "101"}, "limit"), ({"limit": "ten"}, "limit"),
                                          ({"after": "msg_nothing"}, "after"), ({"include[]": "everything"}, "include")])
def test_a_bad_input_items_query_is_a_400_naming_it(clients, query, param):
    a, _ = clients
    made = a.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError) as e:
        a.responses.input_items.list(made.id, extra_query=query)
    assert e.value.body["param"] == param, e.value.body


def test_a_kept_response_is_its_callers_alone_and_can_be_read_and_deleted(clients):
    a, b = clients
    made = a.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0)
    read = a.responses.retrieve(made.id)
    assert (read.id, read.output_text, read.usage.output_tokens) == (made.id, made.output_text, made.usage.output_tokens)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(made.id)  # holder-b's key: as if it never existed
    with pytest.raises(openai.NotFoundError) as e:
        b.responses.create(model=MODEL, previous_response_id=made.id, input="And another?", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    a.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(made.id)
    unkept = a.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0, store=False)
    assert not unkept.store
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unkept.id)


def test_past_the_limit_the_oldest_is_dropped(clients):
    a, _ = clients
    ids = [a.responses.create(model=MODEL, input=f"Count to {i}.", max_output_tokens=2, temperature=0).id
           for i in range(KEPT + 1)]
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(ids[0])
    assert [a.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_the_store_keeps_the_last_ones_per_owner_and_none_when_off():
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"r{i}", Kept("a", ({"role": "user", "content": str(i)},), {"id": f"r{i}"}))
    with pytest.raises(NotFound):
        store.get("r0", "a")
    assert store.get("r2", "a").response == {"id": "r2"}
    with pytest.raises(NotFound, match="another API key's"):
        store.get("r2", "b")
    store.delete("r2", "a")
    with pytest.raises(NotFound):
        store.delete("r2", "a")
    with pytest.raises(InvalidArgument, match="not kept by this server") as e:
        ResponseStore(0).get("r1", "", "previous_response_id")
    assert e.value.param == "previous_response_id"
    with pytest.raises(NotFound):
        ResponseStore(0).get("r1", "")


def test_a_running_answer_dropped_from_the_store_is_cancelled_and_a_settled_one_replaces_it():
    async def run():
        store = ResponseStore(1)
        first, second = (asyncio.create_task(asyncio.sleep(60)) for _ in range(2))
        store.put("r0", Kept("a", (), {"id": "r0", "status": "in_progress"}, running=first))
        store.settle("r0", second, Kept("a", (), {"id": "r0", "status": "completed"}))  # not r0's answer: no change
        assert store.get("r0", "a").running is first
        store.put("r1", Kept("a", (), {"id": "r1", "status": "in_progress"}, running=second))  # r0 dropped
        await asyncio.sleep(0)
        assert first.cancelled()
        store.settle("r0", first, Kept("a", (), {"id": "r0", "status": "cancelled"}))  # dropped: stays dropped
        with pytest.raises(NotFound):
            store.get("r0", "a")
        store.settle("r1", second, Kept("a", (), {"id": "r1", "status": "completed"}))
        assert store.get("r1", "a").response["status"] == "completed" and store.get("r1", "a").running is None
        third = asyncio.create_task(asyncio.sleep(60))
        store.put("r2", Kept("a", (), {"id": "r2"}, running=third))
        await store.close()  # the front door's stop
        assert third.cancelled() and not second.cancelled()

    asyncio.run(run())


def _sized(rid: str, chars: int) -> Kept:
    return Kept("a", ({"role": "user", "content": "q" * chars},), {"id": rid, "output_text": "t" * chars})


def test_past_its_bytes_the_oldest_are_dropped_but_the_newest_is_always_kept():
    async def run():
        store = ResponseStore(100, max_bytes=2000)
        for i in range(3):
            store.put(f"r{i}", _sized(f"r{i}", 300))  # ~660 bytes each as JSON: three fit
        assert 3 * 600 < store.bytes <= 2000 and store.get("r0", "a")
        store.put("r3", _sized("r3", 300))  # a fourth does not: the oldest goes
        with pytest.raises(NotFound):
            store.get("r0", "a")
        assert store.get("r1", "a") and store.bytes <= 2000
        store.delete("r1", "a")
        assert 2 * 600 < store.bytes <= 2 * 700
        store.put("big", _sized("big", 5000))  # alone past the bound: every other goes, it stays
        assert store.get("big", "a") and store.bytes > 2000
        for rid in ("r2", "r3"):
            with pytest.raises(NotFound):
                store.get(rid, "a")
        running, feed = asyncio.create_task(asyncio.sleep(60)), EventFeed()
        store.put("bg", Kept("a", (), {"id": "bg", "status": "in_progress"}, running=running, feed=feed))
        assert store.get("bg", "a")  # small while it runs: "big" goes, being the oldest past the bound
        with pytest.raises(NotFound):
            store.get("big", "a")
        feed.add([{"type": "response.output_text.delta", "delta": "d" * 3000}])
        store.settle("bg", running, Kept("a", (), {"id": "bg", "status": "completed"}, feed=feed))
        assert 3000 < store.bytes == feed.bytes + len(json.dumps({"id": "bg", "status": "completed"})) + 2 * len("[]")
        running.cancel()
    asyncio.run(run())
