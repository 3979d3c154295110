"""The decode worker: owns the KV pool, leases pages to requests, runs the continuous-batching loop.

A request's life on this side of the handoff (every state has a way out that frees its pages):

    reserve ──▶ LEASED ──generate──▶ COMMITTED ──pages ready──▶ RUNNING ──stop/length──▶ done, freed
                  │                      │                        │
          lease deadline            transfer deadline       cancel / error
                  ▼                      ▼                        ▼
                freed                freed + error           freed + "abort"
    release (from any state) ──▶ freed

"Pages ready" is the transport's completion notice (nixl, inproc), or the generate call itself for
shm, whose prefill reply comes only after the last page was written. Calls from Triton's threads
(`reserve`, `generate`, `release`, `stats`) only touch bookkeeping under a lock; the model runs on
the loop thread (`step`), outside the lock.
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from dataclasses import dataclass

from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.transports import PoolEndpoint
from engine.workers.sink import TokenSink
from tandem.wire import DecodeOp, Reservation, WorkerStats


class LeaseState(str, enum.Enum):
    LEASED = "leased"
    COMMITTED = "committed"  # generate arrived; waiting for the pages to be ready
    RUNNING = "running"


@dataclass
class Lease:
    request_id: str
    token: str
    pages: list[int]
    num_tokens: int
    deadline: float
    state: LeaseState = LeaseState.LEASED
    pages_ready: bool = False
    seq: Sequence | None = None
    sink: TokenSink | None = None
    abort_requested: bool = False


class DecodeWorker:
    def __init__(self, engine: Engine, endpoint: PoolEndpoint, *, lease_s: float = 30.0,
                 transfer_timeout_s: float = 30.0, max_batch_size: int = 256, clock=time.monotonic):
        self.engine = engine
        self.endpoint = endpoint
        self.lease_s = lease_s
        self.transfer_timeout_s = transfer_timeout_s
        self.max_batch_size = max_batch_size
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.running: list[Lease] = []  # touched by the loop thread only
        self.lock = threading.Lock()
        self.wakeup = threading.Event()
        self.kv_bytes_received = 0

    # -- control calls (any thread) -----------------------------------------------------------------

    def reserve(self, op: DecodeOp) -> Reservation:
        if not op.request_id:
            raise InvalidRequest("reserve needs a request_id")
        if op.num_tokens < 1 or op.max_tokens < 1:
            raise InvalidRequest(f"reserve needs num_tokens >= 1 and max_tokens >= 1, got {op.num_tokens}, "
                                 f"{op.max_tokens}")
        budget = min(op.num_tokens + op.max_tokens, self.engine.max_context)
        if op.num_tokens >= self.engine.max_context:
            raise InvalidRequest(f"{op.num_tokens} tokens do not fit the model's context of {self.engine.max_context}")
        lease_s = op.lease_ms / 1000 if op.lease_ms > 0 else self.lease_s
        with self.lock:
            if op.request_id in self.leases:
                raise InvalidRequest(f"request {op.request_id!r} already holds a reservation here")
            pages = self.engine.allocator.allocate(self.engine.cache.layout.pages_for(budget))  # OutOfPages
            lease = Lease(op.request_id, secrets.token_hex(8), pages, op.num_tokens, self.clock() + lease_s)
            self.leases[op.request_id] = lease
        return Reservation(op.request_id, lease.token, pages, int(lease_s * 1000), self.endpoint.descriptor())

    def generate(self, op: DecodeOp, sink: TokenSink) -> None:
        """Commit a lease and queue the request; tokens go to `sink`. Raises InvalidRequest at once."""
        params = SamplingParams.from_dict(op.sampling)
        if not op.output_ids:
            raise InvalidRequest("generate needs output_ids: at least the first token from prefill")
        with self.lock:
            lease = self._owned(op)
            if lease.state is not LeaseState.LEASED:
                raise InvalidRequest(f"request {op.request_id!r} is already {lease.state.value}")
            if len(op.prompt_ids) + len(op.output_ids) != lease.num_tokens + 1:
                raise InvalidRequest(f"request {op.request_id!r} reserved pages for {lease.num_tokens} tokens; "
                                     f"generate sent {len(op.prompt_ids)} prompt + {len(op.output_ids)} output "
                                     f"tokens (expected a total of {lease.num_tokens + 1})")
            seq = self.engine.new_sequence(op.request_id, op.prompt_ids, params, op.output_ids)
            need = self.engine.cache.layout.pages_for(seq.budget)
            if need > len(lease.pages):
                raise InvalidRequest(f"request {op.request_id!r} needs {need} pages for max_tokens "
                                     f"{params.max_tokens}; it reserved {len(lease.pages)}")
            seq.page_table, seq.num_cached = lease.pages, lease.num_tokens
            lease.seq, lease.sink, lease.state = seq, sink, LeaseState.COMMITTED
            lease.pages_ready = lease.pages_ready or not self.endpoint.notifies
            lease.deadline = self.clock() + self.transfer_timeout_s
        self.wakeup.set()

    def release(self, op: DecodeOp) -> bool:
        """Free a request's pages in whatever state it is; a committed or running stream ends with 'abort'.

        A running request is stopped by the loop thread before its next step (it owns that stream).
        """
        with self.lock:
            lease = self._owned(op)
            if lease.state is LeaseState.RUNNING:
                lease.abort_requested = True
            else:
                self._free(lease)
                if lease.sink is not None:
                    lease.sink.finish("abort")
        self.wakeup.set()
        return True

    def stats(self) -> WorkerStats:
        with self.lock:
            states = [lease.state for lease in self.leases.values()]
            a = self.engine.allocator
            return WorkerStats(role="decode", pages_total=a.num_pages, pages_used=a.num_used,
                               running=states.count(LeaseState.RUNNING), leased=states.count(LeaseState.LEASED),
                               waiting_for_pages=states.count(LeaseState.COMMITTED),
                               kv_bytes_received=self.kv_bytes_received)

    def _owned(self, op: DecodeOp) -> Lease:
        lease = self.leases.get(op.request_id)
        if lease is None:
            raise InvalidRequest(f"unknown request id {op.request_id!r}: no reservation here (expired or released?)")
        if not secrets.compare_digest(lease.token, op.lease):
            raise InvalidRequest(f"request {op.request_id!r}: pages are leased to someone else (lease token mismatch)")
        return lease

    def _free(self, lease: Lease) -> None:
        """Forget the lease and return its pages (caller holds the lock)."""
        self.leases.pop(lease.request_id, None)
        if lease.pages:
            self.engine.allocator.free(lease.pages)
            lease.pages = []
            if lease.seq is not None:
                lease.seq.page_table = []

    # -- the loop (one thread) ----------------------------------------------------------------------

    def step(self) -> bool:
        """Admit ready requests, run one decode step for the batch, stream tokens. True if work was done."""
        with self.lock:
            self._housekeeping()
        batch = list(self.running)
        if not batch:
            return False
        outs = self.engine.decode_step([lease.seq for lease in batch])
        done = []
        for lease, (token, logprob) in zip(batch, outs):
            reason = lease.seq.finish_reason.value if lease.seq.finished else None
            lease.sink.send(token, logprob, reason)
            if reason:
                done.append(lease)
        if done:
            with self.lock:
                for lease in done:
                    self._free(lease)
            self.running = [lease for lease in self.running if lease not in done]
        return True

    def _housekeeping(self) -> None:
        """Expire leases, note arrived pages, stop released or cancelled streams, admit ready requests."""
        for rid in self.endpoint.poll():
            if rid in self.leases:
                self.leases[rid].pages_ready = True
        now = self.clock()
        for lease in list(self.leases.values()):
            cancelled = lease.sink is not None and lease.sink.cancelled()
            if lease.state is LeaseState.RUNNING:
                if lease.abort_requested or cancelled:
                    self._free(lease)
                    self.running.remove(lease)
                    lease.sink.finish("abort")
            elif cancelled:
                self._free(lease)
                lease.sink.finish("abort")
            elif now > lease.deadline:
                self._free(lease)
                if lease.sink is not None:
                    lease.sink.fail(f"request {lease.request_id}: KV pages never arrived (transfer timed out); "
                                    f"pages freed")
            elif lease.state is LeaseState.COMMITTED and lease.pages_ready and \
                    len(self.running) < self.max_batch_size:
                lease.state = LeaseState.RUNNING
                self.running.append(lease)
                self.kv_bytes_received += lease.num_tokens * self.engine.cache.layout.bytes_per_token

    def run(self, stop: threading.Event) -> None:
        """The loop thread's body: step while there is work; when idle, wait for a call or a deadline.

        Leases and notifying transports need polling, so an idle loop with leases wakes every 2 ms.
        """
        while not stop.is_set():
            if not self.step():
                self.wakeup.wait(0.002 if self.leases else 0.1)
                self.wakeup.clear()
