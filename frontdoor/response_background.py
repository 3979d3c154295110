"""Background responses (`background: true` on POST /v1/responses): answered after the reply, read with GET.

The POST replies once the answer's first token came, so a refusal before it (a 400 where the chat is
prepared, a 429 at admission, a 503) is still its HTTP status, as a stream's is. Its reply is the
response `in_progress` with no output yet (or the whole response, when the answer ended that soon).
The answer then goes on in a task whatever the client does: it holds its admission place (so it
counts against `limits.max_in_flight` and the per-key limit) and its end replaces the kept response:
`completed` or `incomplete` with its output, `failed` with the error, or `cancelled`. POST
/v1/responses/{id}/cancel cancels it; DELETE and being dropped as the oldest kept do too
(frontdoor/response_store.py), and so does the front door's stop once the drain's grace is over. A
client that leaves before the reply cancels it: nobody learned its id.

With `stream: true` the reply is the response's events (frontdoor/response_events.EventFeed), from the
first, as the answer makes them; a client that leaves the stream leaves the answer going, and may follow
it again from where it left (GET with `stream=true&starting_after=N`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from frontdoor.response_store import Kept, ResponseStore
from tandem.status import InvalidArgument, Status, TandemError, status_of

log = logging.getLogger("tandem.http")


async def start(store: ResponseStore, rid: str, running: Kept, answer: Callable[[Callable], Awaitable],
                ended: Callable[[object], Kept]) -> dict:
    """Answer response `rid` in a task and return the POST's reply once its first delta came. `running`:
    the response as it is kept while it is made (its owner, the response in progress, its input items,
    and the `feed` of a streamed one, which `answer` adds its events to; it is ended here with the
    response). `answer(on_delta)` makes the answer, calling `on_delta` with each delta; `ended(result)`
    makes the kept response of what `answer` returned. An answer that failed before the reply raises its
    error."""
    first = asyncio.Event()
    task = asyncio.create_task(answer(lambda _delta: first.set()))
    came = asyncio.create_task(first.wait())
    try:
        await asyncio.wait({task, came}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the client left before it learned the id
        task.cancel()
        raise
    finally:
        came.cancel()
    if task.done():
        kept = dataclasses.replace(ended(task.result()), feed=running.feed)  # raises the answer's error
        store.put(rid, kept)
        _end_feed(rid, kept)
        return kept.response
    store.put(rid, dataclasses.replace(running, running=task))
    task.add_done_callback(lambda t: store.settle(rid, t, _end(rid, t, running, ended)))
    return running.response


async def cancel(store: ResponseStore, rid: str, owner: str) -> dict:
    """Cancel background response `rid` of `owner` if it is still being made; the response as it is then.
    NotFound as `store.get`; InvalidArgument for a response not made in the background."""
    kept = store.get(rid, owner)
    if not kept.response.get("background"):
        raise InvalidArgument(f"response {rid} was not made in the background; only a background response can "
                              f"be cancelled")
    if kept.running is not None:
        kept.running.cancel()
        await asyncio.wait({kept.running})  # its done callback (registered first) settled it before this returns
    return store.get(rid, owner).response


def _end(rid: str, task: asyncio.Task, running: Kept, ended: Callable[[object], Kept]) -> Kept:
    """The kept response of a background answer that ended as `task` did (`running`: as it was kept while
    it ran, its task aside); a feed's readers get its last event."""
    try:
        kept = dataclasses.replace(ended(task.result()), feed=running.feed)  # raises its error, or CancelledError
    except asyncio.CancelledError:
        kept = _as(running, {"status": "cancelled"})
    except TandemError as e:
        status = status_of(e)
        kept = _as(running, {"status": "cancelled"} if status == Status.CANCELLED else
                   {"status": "failed", "error": {"code": status.value, "message": str(e)}})
    except Exception as e:  # a bug: the log holds its traceback, the response names the log
        log.error("background response %s failed", rid, exc_info=e)
        kept = _as(running, {"status": "failed", "error": {
            "code": Status.INTERNAL.value, "message": f"internal error ({type(e).__name__}); see the server log"}})
    log.info("background response %s ended %s", rid, kept.response["status"])
    _end_feed(rid, kept)
    return kept


def _as(running: Kept, change: dict) -> Kept:
    return dataclasses.replace(running, response=running.response | change)


def _end_feed(rid: str, kept: Kept) -> None:
    """End the feed of a streamed background response that ended as `kept` says."""
    if kept.feed is None:
        return
    status = kept.response["status"]
    if status == "failed":
        kept.feed.end("response.failed", response=kept.response)
    elif status == "cancelled":
        kept.feed.end("error", code=Status.CANCELLED.value, message=f"response {rid} was cancelled", param=None)
    else:  # completed or incomplete: its closing events are the feed's last
        kept.feed.end()
