"""The paged KV pool's storage (its caching page allocator: engine/page_allocator.py).

Storage is one tensor `[layers, 2 (k|v), pages, tokens_per_page, kv_heads, head_dim]`, either ordinary
memory or owner-only POSIX shared memory that another process (a prefill worker) can map and write.
A request owns a page table: the list of page ids holding its tokens in order; token `t` of the
request lives in page `table[t // tokens_per_page]` at row `t % tokens_per_page`.
"""

from __future__ import annotations

import torch

from engine.shm_region import SharedBuffer
from tandem.kv_layout import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVCache:
    """Page storage for all layers. `k(layer)`/`v(layer)`: [pages, tokens_per_page, kv_heads, head_dim]."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu", shared: bool = False):
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.shape = (layout.num_layers, 2, num_pages, layout.tokens_per_page, layout.num_kv_heads, layout.head_dim)
        dtype = TORCH_DTYPES[layout.dtype]
        self.shm: SharedBuffer | None = None
        if shared:
            if self.device.type != "cpu":
                raise ValueError("a shared-memory KV pool lives in host memory; use device 'cpu'")
            self.shm = SharedBuffer.create(layout.page_bytes * 2 * layout.num_layers * num_pages, tag="kv")
            self.data = self.shm.tensor(dtype, self.shape)
        else:
            self.data = torch.zeros(self.shape, dtype=dtype, device=self.device)
        # views made once (not a dispatch per layer and pass): [2, pages, tpp, kv_heads, head_dim] per layer,
        self._layer = list(self.data)  # and its k / v slots [pages * tpp, kv_heads, head_dim]
        self._k_slots = [layer[0].flatten(0, 1) for layer in self._layer]
        self._v_slots = [layer[1].flatten(0, 1) for layer in self._layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] stored at flat slots [T] (page * tokens_per_page + row)."""
        self._k_slots[layer].index_copy_(0, slots, k)
        self._v_slots[layer].index_copy_(0, slots, v)

    def layer_kv(self, layer: int) -> torch.Tensor:
        """One layer's storage, a view: [2 (k|v), pages, tokens_per_page, kv_heads, head_dim]."""
        return self._layer[layer]

    def gather_pages(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tables: [B, P] page ids -> k, v: [B, P * tokens_per_page, kv_heads, head_dim], in page order."""
        kv = self._layer[layer].index_select(1, tables.flatten())  # [2, B*P, tpp, kv_heads, head_dim]: one copy
        kv = kv.view(2, tables.shape[0], -1, *kv.shape[3:])  # [2, B, P*tpp, kv_heads, head_dim]
        return kv[0], kv[1]

    def pages(self, page_ids: list[int]) -> torch.Tensor:
        """A copy of the given pages of all layers: [layers, 2, len(page_ids), tpp, kv_heads, head_dim]."""
        return self.data[:, :, page_ids].clone()

    def load_pages(self, page_ids: list[int], content: torch.Tensor) -> None:
        """Write a copy made by `pages` into (possibly different) page ids of this pool."""
        self.data[:, :, page_ids] = content.to(self.data.dtype)

    def close(self) -> None:
        """Release the storage; a shared pool's segment is unlinked (it is ours)."""
        if self.shm is not None:
            del self.data, self._layer, self._k_slots, self._v_slots
            self.shm.close()
            self.shm.unlink()
            self.shm = None

