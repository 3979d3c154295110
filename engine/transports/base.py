"""The KV transport interface: how a prefill worker's K/V reach pages a decode worker reserved.

Two sides, a handful of methods, and one state enum:
- `PoolEndpoint` (decode side, one per transport the pool offers): `part()` is its piece of the pool
  descriptor (tandem/pool.py); `poll()` returns the notices that arrived (pages ready, writers closed)
  for transports that notify. It never blocks and never touches pages itself.
- `KVSender` (prefill side, one per transport and process): `writer(destination, request_id)` opens a
  `LayerWriter` for one request. `write_layer` may return before the bytes land (overlapping the next
  layer's compute) and never raises: a failure (fence revoked, peer gone) is recorded, the writer stops
  writing, and `finish` raises it. `finish` returns only when every layer landed; `abort` stops a writer
  and, for notifying transports, tells the decode side that this writer is closed.

Fencing (see control/handoff.py for the whole argument): shm, cuda_ipc and inproc writers check the
lease's epoch in the fence table (engine/transports/fence.py) around every copy (cuda_ipc holds it until
its copy's completion event), so a revoke is final at once (`strict_fence`). A NIXL writer writes one-sided into remote memory and cannot be checked; its fence is
its own close notice (sent after its last WRITE completed), so the decode side keeps a released lease's
pages out of use until that notice arrives or the writer is known dead.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from tandem.kv_layout import KVLayout, check_kv_compatible
from tandem.pool import Destination
from tandem.status import TandemError, TransferFailed


class TransferState(str, enum.Enum):
    WRITING = "writing"  # layers are being written
    DONE = "done"  # every layer landed and the decode side has been (or will be) told
    FAILED = "failed"  # a write failed or the lease was revoked; nothing more is written
    ABORTED = "aborted"  # stopped on purpose; nothing more is written


@dataclass
class Notices:
    """What a notifying transport reported since the last poll."""

    ready: set[str] = field(default_factory=set)  # request ids whose pages all landed
    closed: set[tuple[int, int]] = field(default_factory=set)  # (slot, epoch) of writers that will write no more


class PoolEndpoint(ABC):
    name: str
    notifies: bool = False  # True: pages are ready only once poll() reports the request id
    strict_fence: bool = True  # True: revoking the fence slot stops its writer at once

    @abstractmethod
    def part(self):
        """This transport's piece of the PoolDescriptor (ShmPool, NixlPool, InprocPool)."""

    def poll(self) -> Notices:
        return Notices()

    def needs_progress(self) -> bool:
        """True when this transport must be polled while writes to it may be in flight (see KVSender)."""
        return False

    def close(self) -> None:
        return None


def page_runs(page_ids: list[int]) -> list[tuple[int, int, int]]:
    """Split a page table into runs of consecutive ids: (index in the table, first page id, length)."""
    runs = []
    for i, p in enumerate(page_ids):
        if runs and p == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, p, 1))
    return runs


def copy_into_pages(pages: torch.Tensor, runs: list[tuple[int, int, int]], x: torch.Tensor) -> None:
    """Write token rows x: [n, kv_heads, head_dim] into pages: [P, tokens_per_page, kv_heads, head_dim],
    following a page table given as runs (see page_runs): one bulk copy per run of consecutive pages."""
    tpp = pages.shape[1]
    n = x.shape[0]
    for index, first, length in runs:
        start = index * tpp
        if start >= n:
            break
        rows = min(length * tpp, n - start)
        pages[first:first + length].view(-1, *pages.shape[2:])[:rows].copy_(x[start:start + rows])


class LayerWriter(ABC):
    """Writes one request's K/V, layer by layer, into its destination pages."""

    def __init__(self, request_id: str, dest: Destination, layout: KVLayout):
        num_pages = dest.pool.num_pages
        bad = [p for p in dest.page_ids if not 0 <= p < num_pages]
        if not dest.page_ids or bad or len(set(dest.page_ids)) != len(dest.page_ids):
            raise TransferFailed(f"request {request_id}: destination pages must be distinct pages of a pool "
                                 f"with {num_pages} pages")
        if dest.start % layout.tokens_per_page:
            raise TransferFailed(f"request {request_id}: destination start {dest.start} is not on a page boundary")
        self.request_id = request_id
        self.dest = dest
        self.layout = layout
        self.state = TransferState.WRITING
        self.error: TandemError | None = None
        self.bytes_written = 0

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """k, v: [tokens, kv_heads, head_dim] for positions start..start+tokens-1 of the request (a prompt
        written in chunks calls this once per chunk and layer). Positions before the destination's
        `start` (already held by the decode worker) are skipped. Never raises; see `finish`."""
        if self.state is not TransferState.WRITING:
            return
        skip = max(0, self.dest.start - start)
        if skip >= k.shape[0]:
            return
        start, k, v = start + skip, k[skip:], v[skip:]
        try:
            self._write(layer, k, v, self._runs(k.shape[0], start))
        except TandemError as e:
            self.fail(e)

    def stop(self) -> None:
        """From any thread: write no further layer (the loop thread calls `abort` afterwards)."""
        if self.state is TransferState.WRITING:
            self.state = TransferState.ABORTED

    def fail(self, e: TandemError) -> None:
        """Record the first failure; nothing more is written."""
        if self.error is None:
            self.error = e
        self.state = TransferState.FAILED

    def _runs(self, n_tokens: int, start: int) -> list[tuple[int, int, int]]:
        """Runs of consecutive destination pages holding positions [start, start + n_tokens)."""
        tpp = self.layout.tokens_per_page
        if start % tpp:
            raise TransferFailed(f"request {self.request_id}: a write must start on a page boundary "
                                 f"(multiple of {tpp}), got position {start}")
        n = self.layout.pages_for(start + n_tokens)
        if n > len(self.dest.page_ids):
            raise TransferFailed(f"request {self.request_id}: {start + n_tokens} tokens need {n} pages, "
                                 f"destination has {len(self.dest.page_ids)}")
        return page_runs(self.dest.page_ids[start // tpp:n])

    @abstractmethod
    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, runs: list) -> None:
        """Copy (or start copying) one layer into the runs; raise a TandemError on failure."""

    def settle(self) -> None:
        """Block until no write is in flight, and tell no one (the pass is redone: its layers are written
        again). Copies that land before `write_layer` returns have nothing to wait for."""

    @abstractmethod
    def finish(self) -> None:
        """Block until every layer landed; raise the recorded error (LeaseLost, TransferFailed) if any."""

    @abstractmethod
    def abort(self) -> None:
        """Stop; wait until nothing is in flight; tell the decode side this writer is closed."""


class DiscardWriter:
    """No destination: compute the first token only (a benchmark baseline, or a probe)."""

    bytes_written = 0

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        return None

    def stop(self) -> None:
        return None

    def settle(self) -> None:
        return None

    def finish(self) -> None:
        return None

    def abort(self) -> None:
        return None


def pool_part(pool, name: str, layout: KVLayout, what: str):
    """`pool`'s part for transport `name` (a PoolDescriptor's shm/nixl/... field), checked against this
    side's KV layout; TransferFailed if it has none or the layouts differ. Never echoes the descriptor:
    it may hold another pool's access keys."""
    part = getattr(pool, name, None)
    if part is None:
        raise TransferFailed(f"{what} pool offers {list(pool.transports)}, not {name!r}")
    try:
        check_kv_compatible(layout, pool.layout)
    except ValueError as e:
        raise TransferFailed(str(e)) from None
    return part


class KVSender(ABC):
    name: str

    def __init__(self, layout: KVLayout):
        self.layout = layout  # the prefill engine's layout; a destination pool must match it

    def check(self, dest: Destination):
        """The destination's part for this transport; TransferFailed if absent or incompatible."""
        return pool_part(dest.pool, self.name, self.layout, "destination")

    @abstractmethod
    def writer(self, dest: Destination, request_id: str) -> LayerWriter: ...

    def progress_due(self) -> float | None:
        """When (monotonic) `progress` should next be called; None: nothing is pending. Transports
        without a progress thread of their own (NIXL over UCX's TCP) need it so that completed writes
        and notices actually leave this process."""
        return None

    def progress(self) -> None:
        return None

    def close(self) -> None:
        return None
