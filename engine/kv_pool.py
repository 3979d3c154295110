"""The paged KV pool: fixed-size pages, a free list with reference counts, and the page storage.

Storage is one tensor `[layers, 2 (k|v), pages, tokens_per_page, kv_heads, head_dim]`, either ordinary
memory or owner-only POSIX shared memory that another process (a prefill worker) can map and write.
A request owns a page table: the list of page ids holding its tokens in order; token `t` of the
request lives in page `table[t // tokens_per_page]` at row `t % tokens_per_page`.
"""

from __future__ import annotations

from collections import deque

import torch

from engine.errors import OutOfPages
from engine.shm import SharedBuffer
from tandem.kv_layout import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PageAllocator:
    """Hands out page ids. `allocate` is all-or-nothing: on OutOfPages nothing changed."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least 1 page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if not self.can_allocate(n):
            raise OutOfPages(n, len(self._free))
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a reference to pages another owner already holds (e.g. a shared prompt prefix)."""
        self._check_owned(pages)
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page with no references returns to the free list."""
        self._check_owned(pages)
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def _check_owned(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages or self._refs[p] == 0:
                raise ValueError(f"page {p} is not allocated in this pool (pool has {self.num_pages} pages)")


class KVCache:
    """Page storage for all layers. `k(layer)`/`v(layer)`: [pages, tokens_per_page, kv_heads, head_dim]."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu",
                 shared: bool = False):
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.shape = (layout.num_layers, 2, num_pages, layout.tokens_per_page, layout.num_kv_heads,
                      layout.head_dim)
        dtype = TORCH_DTYPES[layout.dtype]
        self.shm: SharedBuffer | None = None
        if shared:
            if self.device.type != "cpu":
                raise ValueError("a shared-memory KV pool lives in host memory; use device 'cpu'")
            nbytes = layout.page_bytes * 2 * layout.num_layers * num_pages
            self.shm = SharedBuffer.create(nbytes, tag="kv")
            self.data = self.shm.tensor(dtype, self.shape)
        else:
            self.data = torch.zeros(self.shape, dtype=dtype, device=self.device)
        # Flat per-layer views: [layers, 2, pages * tokens_per_page, kv_heads, head_dim]
        self.flat = self.data.view(layout.num_layers, 2, num_pages * layout.tokens_per_page,
                                   layout.num_kv_heads, layout.head_dim)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] stored at flat slots [T] (page * tokens_per_page + row)."""
        self.flat[layer, 0].index_copy_(0, slots, k)
        self.flat[layer, 1].index_copy_(0, slots, v)

    def gather_pages(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tables: [B, P] page ids -> k, v: [B, P * tokens_per_page, kv_heads, head_dim], in page order."""
        B, P = tables.shape
        shape = (B, P * self.layout.tokens_per_page, self.layout.num_kv_heads, self.layout.head_dim)
        flat = tables.flatten()
        return (self.data[layer, 0].index_select(0, flat).view(shape),
                self.data[layer, 1].index_select(0, flat).view(shape))

    def pages(self, page_ids: list[int]) -> torch.Tensor:
        """A copy of the given pages of all layers: [layers, 2, len(page_ids), tpp, kv_heads, head_dim]."""
        return self.data[:, :, page_ids].clone()

    def load_pages(self, page_ids: list[int], content: torch.Tensor) -> None:
        """Write a copy made by `pages` into (possibly different) page ids of this pool."""
        self.data[:, :, page_ids] = content.to(self.data.dtype)

    def close(self) -> None:
        """Release the storage; a shared pool's segment is unlinked (it is ours)."""
        if self.shm is not None:
            del self.flat, self.data
            self.shm.close()
            self.shm.unlink()
            self.shm = None

