"""The handoff protocols, orchestrator side: one attempt of one request on a decode and a prefill worker.
Two of them, chosen per deployment (`handoff: {mode: push|pull}`): push (`handoff`), where the decode
worker reserves first and the prefill worker writes into its pages, and pull (`pull_handoff`), where
the prefill worker keeps the K/V in its own pool and the decode worker reads them.

Push:

    OPEN      decode.open(prompt, writer)  -> Reserved(lease, destination: pages + fence slot/epoch)
      │       the Open call stays open for the request's whole life: the reservation lives exactly as
      │       long as it; it cannot expire while the prompt waits in a live prefill worker's queue
    PREFILL   prefill(prompt, destination) -> the first token; the prefill worker writes each layer's
      │       K/V straight into the leased pages while the next layer computes
    FIRST     the first token goes to the client at once (a first token that ends the request: done)
    START     decode.start(lease, first token) -> the Open call streams the remaining tokens
    DONE      the decode worker ended the Open call and freed the pages

Every exit that is not DONE ends the lease with a Release (sent without waiting, so a request that
is being torn down never blocks on it) and, if the prefill is still running, an Abort; if this
process dies, Triton cancels its calls and the workers drop them. No KV byte passes through here.

Why no late writer can land a write in pages another request holds (the fence):
- a lease's pages go back to the free list only when the decode worker knows its writer is done:
  the prefill answered (Start, or Release with writer_closed), or the writer was fenced out;
- shm (and inproc): the writer checks the lease's epoch in the pool's fence table under a read lock
  around every layer copy; the decode worker revokes the slot under the write lock. After a revoke no
  check can pass and no copy can be in flight (it would hold the lock), whatever the writer does next,
  even if it was stopped and resumes later;
- NIXL: writes are one-sided RDMA into registered memory and cannot be checked remotely. The writer
  sends a `done` or `closed` notice after its last WRITE completed (or after draining them on abort);
  until that notice, or until the writer is known dead, a released lease's pages stay quarantined
  (`pages_fenced` in the worker's stats). A writer that is neither heard from nor known dead within
  the fence timeout (60 s) is presumed gone: the one bounded assumption, documented in docs/.
A request resumed after a failure carries the tokens already streamed (`sent`): they are prefilled
with the prompt and not streamed again.

Prefix cache: the reservation says how many leading tokens the decode worker already holds
(Reserved.cached_tokens; its destination starts after them, so no writer is ever handed a shared
cached page); the prefill worker computes only what its own cache lacks and writes only what the
decode worker lacks. The first token carries the prefill worker's cached count (what the client saved).

Pull (TensorRT-LLM's, vLLM's NixlConnector's and DistServe's shape):

    PREFILL   prefill(prompt, pull)  -> Prefilled(first token, source: PullSource = pool, pages, tokens,
      │       fence slot/epoch, hold id); the K/V stay in the prefill worker's own pool under a hold, and
      │       the Prefill call stays open for as long as the hold lives (engine/workers/holds.py)
    FIRST     the first token goes to the client at once (a first token that ends the request: done,
      │       nothing is held)
    OPEN      decode.open(prompt, source) -> the decode worker reserves pages (its prefix cache first)
      │       and READS the positions it lacks from the source pages, layer by layer
    PULLED    decode answers Pulled -> unhold(prefill, hold id): the prefill pages go back
    DONE      the Open call streams the remaining tokens from the first token on, and ends

Every exit that is not DONE ends the hold (Unhold; an Abort while the prefill still runs) and the
decode lease (Release), both sent without waiting. The hold lives exactly as long as its request, no
timer: it ends on the orchestrator's word, or when its caller is gone (this process died: Triton
cancels the Prefill call, a sweep on the worker finds it), or with its worker. A request resumed after
a decode failure is prefilled again (a new hold, maybe on another prefill worker); the old hold ends
with the failed attempt. A decode worker without room (OUT_OF_PAGES on Open) ends the attempt as in
push: the hold ends, the request waits for pages and is prefilled again.

The fence the other way round: a held page is reused only when no reader can still read it. Each
layer is read under the slot's read lock with the epoch checked (engine/transports/pull.py); ending a
hold revokes the slot first, and frees the pages only once the revoke held the write lock, so a read
in flight (even of a reader stopped mid-copy) keeps them out of use, and a late read fails LEASE_LOST
having read nothing. The prefix cache works on both sides as in push: the decode worker reads only
what its cache lacks; the prefill worker computes only what its cache lacks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from control.fleet import WorkerState
from tandem.sampling_params import SamplingParams
from tandem.status import Status, TandemError, Unavailable, status_of
from tandem.wire import Open, Prefill, Prefilled, Pulled, Reserved, Start, Token


@dataclass
class Timings:
    start: float = field(default_factory=time.perf_counter)
    reserved: float = 0.0
    first_token: float = 0.0
    transport: str = ""  # how the pages travelled (the decode worker chose it for this pair)
    prefilled: Prefilled | None = None
    decode_cached: int = 0  # prompt tokens the decode worker already held (none of their KV was moved)
    pulled: Pulled | None = None  # pull: the decode worker's read
    pulled_at: float = 0.0


def blame(e: TandemError, worker: WorkerState) -> TandemError:
    """Tag an error with the worker it came from (the retry loop avoids that worker next time)."""
    if getattr(e, "worker", None) is None:
        e.worker = worker
    return e


async def until_finished(tokens: AsyncIterator[Token], worker: str, request_id: str) -> AsyncIterator[Token]:
    """A worker's token stream up to and including the token with a finish reason; a stream that ends
    without one is the worker's fault (Unavailable)."""
    async for tok in tokens:
        yield tok
        if tok.finish_reason:
            return
    raise Unavailable(f"{worker} ended the stream of {request_id} without a finish reason")


async def handoff(decode: WorkerState, prefill: WorkerState, request_id: str, prompt_ids: list[int],
                  params: SamplingParams, sent: list[int], timings: Timings) -> AsyncIterator[Token]:
    """Yield the request's tokens after `sent`; raises a TandemError tagged with the failing worker."""
    opened = decode.client.open(Open(request_id, list(prompt_ids), params, list(sent), writer=prefill.name,
                                     writer_host=prefill.host))
    lease, writer_running, done = "", False, False
    try:
        try:
            reserved = await opened.__anext__()
        except StopAsyncIteration:
            raise Unavailable(f"{decode.name} ended the request before reserving pages") from None
        if not isinstance(reserved, Reserved):
            raise Unavailable(f"{decode.name} answered Open with {type(reserved).__name__}, not Reserved")
        lease, timings.reserved = reserved.lease, time.perf_counter()
        timings.decode_cached = reserved.cached_tokens
        timings.transport = reserved.destination.transport
        writer_running = True
        try:
            first = await prefill.client.prefill(Prefill(request_id, list(prompt_ids), params, list(sent),
                                                         reserved.destination))
        except TandemError as e:
            raise blame(e, prefill) from None
        writer_running = False  # it answered: its writer is closed, whatever the answer was
        timings.first_token, timings.prefilled = time.perf_counter(), first
        yield Token(first.token, first.logprob, first.finish_reason, cached_tokens=first.cached_tokens)
        if first.finish_reason:
            return
        await decode.client.start(Start(request_id, lease, first.token, first.logprob))
        async for tok in until_finished(opened, decode.name, request_id):
            yield tok
        done = True
    except TandemError as e:
        raise blame(e, decode) from None
    finally:
        if writer_running:
            prefill.client.abort(request_id)
        if not done and lease:
            decode.client.release(request_id, lease, writer_closed=not writer_running)
        await opened.aclose()


async def pull_handoff(decode: WorkerState, prefill: WorkerState, request_id: str, prompt_ids: list[int],
                       params: SamplingParams, sent: list[int], timings: Timings) -> AsyncIterator[Token]:
    """The pull protocol (see above); yields the request's tokens after `sent`, raises a TandemError
    tagged with the failing worker."""
    sent = list(sent)  # the caller appends every token it is given, the first one included: take them now
    held = prefill.client.prefill_held(Prefill(request_id, list(prompt_ids), params, list(sent), pull=True))
    source, prefilling, opened, done = None, True, None, False
    try:
        try:
            first = await held.__anext__()
        except StopAsyncIteration:
            raise blame(Unavailable(f"{prefill.name} ended the prefill of {request_id} without an answer"),
                        prefill) from None
        except TandemError as e:
            raise blame(e, prefill) from None
        if not isinstance(first, Prefilled):
            raise blame(Unavailable(f"{prefill.name} answered a pull prefill with {type(first).__name__}"), prefill)
        prefilling, source = False, first.source
        timings.first_token, timings.prefilled = time.perf_counter(), first
        timings.reserved = timings.start  # nothing waited for a decode worker before the prefill
        yield Token(first.token, first.logprob, first.finish_reason, cached_tokens=first.cached_tokens)
        if first.finish_reason:
            return
        if source is None:
            raise blame(Unavailable(f"{prefill.name} held nothing for {request_id} (no pull source)"), prefill)
        timings.transport = source.transport
        opened = decode.client.open(Open(request_id, list(prompt_ids), params, list(sent), writer=prefill.name,
                                         writer_host=prefill.host, source=source))
        try:
            pulled = await opened.__anext__()
        except StopAsyncIteration:
            raise Unavailable(f"{decode.name} ended the request before reading its K/V") from None
        except TandemError as e:  # a read refused by the fence or a source gone: the prefill side's doing
            lost = status_of(e) in (Status.LEASE_LOST, Status.TRANSFER_FAILED)
            raise blame(e, prefill if lost else decode) from None
        if not isinstance(pulled, Pulled):
            raise Unavailable(f"{decode.name} answered a pull Open with {type(pulled).__name__}, not Pulled")
        timings.pulled, timings.pulled_at, timings.decode_cached = pulled, time.perf_counter(), pulled.cached_tokens
        prefill.client.unhold(request_id, source.hold)
        source = None
        async for tok in until_finished(opened, decode.name, request_id):
            yield tok
        done = True
    except TandemError as e:
        raise blame(e, decode) from None
    finally:
        if prefilling:
            prefill.client.abort(request_id)
        if source is not None:
            prefill.client.unhold(request_id, source.hold)
        if opened is not None:
            if not done:
                decode.client.release(request_id, "", writer_closed=True)
            await opened.aclose()
        await held.aclose()
