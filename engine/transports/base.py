"""The KV transport interface: how a prefill worker's K/V reach pages a decode worker reserved.

Two sides, a handful of methods, and one state enum:
- `PoolEndpoint` (decode side, owns the pool): `descriptor()` tells writers how to reach the pool;
  `poll()` returns the request ids whose pages have fully landed (for transports that notify).
  It never blocks and never touches pages itself.
- `KVSender` (prefill side, one per process): `writer(pool, request_id, page_ids)` opens a
  `LayerWriter` for one request. `write_layer` may return before the bytes land (overlapping the
  next layer's compute); `finish` returns only when every layer landed, or raises TransferError;
  `abort` stops a writer and sends no completion.

A descriptor is a JSON object: {"transport": name, "layout": KVLayout dict, "num_pages": N, ...}.
It may carry access keys (NIXL agent metadata), so it travels only on the control channel.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch

from tandem.kv_layout import KVLayout, check_kv_compatible


class TransferState(str, enum.Enum):
    WRITING = "writing"  # layers are being written
    DONE = "done"  # every layer landed and the decode side has been (or will be) told
    FAILED = "failed"  # the peer vanished, a write failed, or a descriptor was bad; pages must be released
    ABORTED = "aborted"  # stopped on purpose; no completion was sent


class TransferError(Exception):
    """A transfer cannot be done or did not complete. The message names the cause."""


class PoolEndpoint(ABC):
    notifies: bool = False  # True: pages are ready only once poll() reports the request id

    @abstractmethod
    def descriptor(self) -> dict: ...

    def poll(self) -> set[str]:
        """Request ids whose pages completed since the last call (empty for non-notifying transports)."""
        return set()

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

    def __init__(self, request_id: str, page_ids: list[int], layout: KVLayout, num_pages: int):
        if not page_ids:
            raise TransferError(f"request {request_id}: destination has no pages")
        bad = [p for p in page_ids if not 0 <= p < num_pages]
        if bad or len(set(page_ids)) != len(page_ids):
            raise TransferError(f"request {request_id}: destination pages {bad or page_ids} are not distinct "
                                f"pages of a pool with {num_pages} pages")
        self.request_id = request_id
        self.page_ids = page_ids
        self.layout = layout
        self.state = TransferState.WRITING
        self.bytes_written = 0

    def _pages(self, n_tokens: int, start: int) -> list[int]:
        """Destination pages holding positions [start, start + n_tokens); `start` must begin a page."""
        tpp = self.layout.tokens_per_page
        if start % tpp:
            raise TransferError(f"request {self.request_id}: a write must start on a page boundary "
                                f"(multiple of {tpp}), got position {start}")
        n = self.layout.pages_for(start + n_tokens)
        if n > len(self.page_ids):
            raise TransferError(f"request {self.request_id}: {start + n_tokens} tokens need {n} pages, "
                                f"destination has {len(self.page_ids)}")
        return self.page_ids[start // tpp:n]

    def _runs(self, n_tokens: int, start: int) -> list[tuple[int, int, int]]:
        """The runs of consecutive destination pages those positions fill (see page_runs)."""
        return page_runs(self._pages(n_tokens, start))

    @abstractmethod
    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """k, v: [tokens, kv_heads, head_dim] for positions start..start+tokens-1 of this request
        (a prompt written in chunks calls this once per chunk and layer)."""

    @abstractmethod
    def finish(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...


class KVSender(ABC):
    def __init__(self, layout: KVLayout):
        self.layout = layout  # the prefill engine's layout; a destination pool must match it

    def check_descriptor(self, pool: dict, name: str) -> tuple[KVLayout, int]:
        if not isinstance(pool, dict) or pool.get("transport") != name:
            # never echo the descriptor: it may hold another pool's access keys
            got = pool.get("transport") if isinstance(pool, dict) else type(pool).__name__
            raise TransferError(f"destination pool is not a {name!r} pool (it says {got!r})")
        try:
            remote = KVLayout.from_dict(pool["layout"])
            num_pages = int(pool["num_pages"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"destination pool descriptor is malformed: {e}") from None
        try:
            check_kv_compatible(self.layout, remote)
        except ValueError as e:
            raise TransferError(str(e)) from None
        return remote, num_pages

    @abstractmethod
    def writer(self, pool: dict, request_id: str, page_ids: list[int]) -> LayerWriter: ...

    def close(self) -> None:
        return None
