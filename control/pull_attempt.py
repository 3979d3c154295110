"""The pull handoff, orchestrator side (TensorRT-LLM's, vLLM's NixlConnector's and DistServe's shape):
one attempt of one request on a prefill and a decode worker, chosen by `handoff: {mode: pull}`.

    PREFILL   prefill(prompt, pull, reader host) -> Prefilled(first token, source: PullSource = transport,
      │       pool, pages, tokens, fence slot/epoch, hold id); the K/V stay in the prefill worker's own
      │       pool under a hold, and the Prefill call stays open for as long as the hold lives
      │       (engine/workers/holds.py); the prefill worker picks the transport from the decode worker's
      │       host: shm (host memory) or cuda_ipc (GPU memory) on one host, NIXL READ otherwise
    FIRST     the first token goes to the client at once (a first token that ends the request: done,
      │       nothing is held)
    OPEN      decode.open(prompt, source) -> the decode worker reserves pages (its prefix cache first)
      │       and READS the positions it lacks from the source pages (engine/transports/pull*.py)
    PULLED    decode answers Pulled -> unhold(prefill, hold id, reader closed): the prefill pages go back
    DONE      the Open call streams the remaining tokens from the first token on, and ends

Every exit that is not DONE ends the hold (Unhold; an Abort while the prefill still runs) and the
decode lease (Release), both sent without waiting. The hold lives exactly as long as its request, no
timer: it ends on the orchestrator's word, or when its caller is gone (this process died: Triton
cancels the Prefill call, a sweep on the worker finds it), or with its worker. A request resumed after
a decode failure is prefilled again (a new hold, maybe on another prefill worker); the old hold ends
with the failed attempt. A decode worker without room (OUT_OF_PAGES on Open) ends the attempt as in
push: the hold ends, the request waits for pages and is prefilled again.

The fence the other way round: a held page is reused only when no reader can still read it.
- shm, cuda_ipc: each layer is read under the slot's read lock with the epoch checked
  (engine/transports/pull.py); ending a hold revokes the slot first, and frees the pages only once the
  revoke held the write lock, so a read in flight (even of a reader stopped mid-copy) keeps them out
  of use, and a late read fails LEASE_LOST having read nothing;
- NIXL: the reader READs the slot's epoch, then the pages, one-sided; the prefill side cannot check
  that. Ending a hold still revokes the slot (a read that starts after it fails LEASE_LOST), and the
  pages come back only once no reader can still read them: the Unhold says `reader_closed` (sent after
  Pulled, the read having ended before it; or when the decode worker was never opened, or refused the
  Open with OUT_OF_PAGES, which it does before reserving), or the reader's `closed` notice arrived
  (sent after every read, and for an Open the decode worker refused or ended before reading it), or
  the fence timeout (`handoff.fence_timeout_s`, 60 s) passed without either: the one bounded
  assumption, the same as push's NIXL writers (control/handoff.py; engine/workers/holds.py).
The prefix cache works on both sides as in push: the decode worker reads only what its cache lacks;
the prefill worker computes only what its cache lacks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from control.handoff import PairAttempt, blame, first_of, first_token
from tandem.status import Status, TandemError, Unavailable, status_of
from tandem.wire import Open, Prefill, Prefilled, Pulled, Token


class PullAttempt(PairAttempt):
    """The pull protocol on one decode and one prefill worker (see the module docstring). Traced as
    `tandem.prefill` (PREFILL) and `tandem.decode_reservation` (OPEN to PULLED: the reservation and the
    read; the decode worker's own `tandem.kv_transfer` span is the read) under the attempt's span."""

    MODE = "pull"

    def __init__(self, *args):
        super().__init__(*args)
        self.held = None  # the prefill worker's Prefill stream: Prefilled, then open while the hold lives
        self.prefilling, self.source = False, None  # source: the PullSource whose hold is not yet ended
        self.on_pulled: Callable[[], None] | None = None  # called once when the decode worker read the K/V
        self.refused = False  # the decode worker refused the Open before reserving (so before any read)

    async def next(self) -> Token | None:
        if self.held is None:
            return await self._first_token()
        if self.opened is None and not self.finished:  # the first token went out: decode reads, then streams
            await self._pull()
        return await self._stream_next()

    async def _first_token(self) -> Token:
        """PREFILL into the prefill worker's own pages, held: the first token and the source."""
        p, t = self.prefill, self.timings
        with self.span.child("tandem.prefill", worker=p.name) as span:
            self.held = p.client.prefill_held(Prefill(self.request_id, self.prompt_ids, self.params, self.sent,
                                                      pull=True, reader_host=self.decode.host,
                                                      reader=self.decode.name, traceparent=span.traceparent()))
            self.prefilling = True
            first = await first_of(self.held, Prefilled, p, f"before the first token of {self.request_id}")
            self.traced_prefill(first, span)
        self.prefilling = False
        self._hold(first.source)
        t.first_token, t.prefilled = time.perf_counter(), first
        t.reserved = t.start  # nothing waited for a decode worker before the prefill
        if self.on_first is not None:
            self.on_first()
        self.finished = first.finish_reason is not None
        return first_token(first)

    async def _pull(self) -> None:
        """OPEN decode with the source; once it answers PULLED, the hold ends (the prefill pages go back)."""
        d, t, source = self.decode, self.timings, self.source
        if source is None:
            raise blame(Unavailable(f"{self.prefill.name} held nothing for {self.request_id} (no pull source)"),
                        self.prefill)
        t.transport = source.transport
        with self.span.child("tandem.decode_reservation", worker=d.name, transport=source.transport) as span:
            self.opened = d.client.open(Open(self.request_id, self.prompt_ids, self.params, self.sent,
                                             writer=self.prefill.name, writer_host=self.prefill.host, source=source,
                                             traceparent=self.span.traceparent()))
            try:
                pulled = await anext(self.opened, None)
            except TandemError as e:  # a read refused by the fence or a source gone: the prefill side's doing
                self.refused = status_of(e) is Status.OUT_OF_PAGES  # refused at once, before it reserved pages
                lost = status_of(e) in (Status.LEASE_LOST, Status.TRANSFER_FAILED)
                raise blame(e, self.prefill if lost else d) from None
            if not isinstance(pulled, Pulled):
                what = "ended the request" if pulled is None else f"answered a pull Open with {type(pulled).__name__}"
                raise blame(Unavailable(f"{d.name} {what} before reading its K/V"), d)
            span.set(kv_bytes=pulled.kv_bytes, kv_seconds=pulled.kv_seconds, cached_tokens=pulled.cached_tokens)
        t.pulled, t.pulled_at, t.decode_cached = pulled, time.perf_counter(), pulled.cached_tokens
        self.mark_placed()  # its pages on the decode worker (not its first token, the prefill worker's)
        self._hold(None)
        self.prefill.client.unhold(self.request_id, source.hold, reader_closed=True)  # the read ended before Pulled
        if self.on_pulled is not None:
            self.on_pulled()

    def _hold(self, source) -> None:
        """The hold not yet ended (None: ended), counted on the prefill worker: its drain waits for it."""
        self.prefill.holds += (source is not None) - (self.source is not None)
        self.source = source

    async def __aexit__(self, *exc) -> None:
        """Every exit that is not DONE: Abort a running prefill, Unhold a hold, Release the decode lease
        (all without waiting)."""
        p = self.prefill
        if self.prefilling:
            p.client.abort(self.request_id)
        if self.source is not None:  # a reader may still read only if decode was opened and did not refuse
            p.client.unhold(self.request_id, self.source.hold, reader_closed=self.opened is None or self.refused)
            self._hold(None)
        if self.opened is not None and not self.ended:
            self.decode.client.release(self.request_id, "", writer_closed=True)
        try:
            await super().__aexit__(*exc)
        finally:
            if self.held is not None:
                await self.held.aclose()
