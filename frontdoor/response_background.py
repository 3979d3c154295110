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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from frontdoor.response_store import Kept, ResponseStore
from tandem.status import InvalidArgument, Status, TandemError, status_of

log = logging.getLogger("tandem.http")


async def start(store: ResponseStore, rid: str, owner: str, answer: Callable[[Callable], Awaitable],
                ended: Callable[[object], Kept], in_progress: dict) -> dict:
    """Answer response `rid` of `owner` in a task and return the POST's reply once its first delta came.
    `answer(on_delta)` makes the answer, calling `on_delta` with each delta; `ended(result)` makes the
    kept response of what `answer` returned; `in_progress` is the response while it is made. An answer
    that failed before the reply raises its error."""
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
        kept = ended(task.result())  # raises the answer's error
        store.put(rid, kept)
        return kept.response
    store.put(rid, Kept(owner, (), in_progress, running=task))
    task.add_done_callback(lambda t: store.settle(rid, t, _end(rid, t, owner, ended, in_progress)))
    return in_progress


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


def _end(rid: str, task: asyncio.Task, owner: str, ended: Callable[[object], Kept], in_progress: dict) -> Kept:
    """The kept response of a background answer that ended as `task` did."""
    try:
        kept = ended(task.result())  # raises the answer's error, or CancelledError
    except asyncio.CancelledError:
        kept = Kept(owner, (), in_progress | {"status": "cancelled"})
    except TandemError as e:
        status = status_of(e)
        kept = Kept(owner, (), in_progress | ({"status": "cancelled"} if status == Status.CANCELLED else
                                             {"status": "failed", "error": {"code": status.value, "message": str(e)}}))
    except Exception as e:  # a bug: the log holds its traceback, the response names the log
        log.error("background response %s failed", rid, exc_info=e)
        kept = Kept(owner, (), in_progress | {"status": "failed", "error": {
            "code": Status.INTERNAL.value, "message": f"internal error ({type(e).__name__}); see the server log"}})
    log.info("background response %s ended %s", rid, kept.response["status"])
    return kept
