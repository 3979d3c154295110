"""The page allocator, the KV storage, and owner-only shared memory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

from engine.errors import OutOfPages
from engine.kv_pool import KVCache
from engine.page_allocator import PageAllocator
from tandem.sampling_params import SamplingParams
from engine.shm_region import our_segments
from tandem.kv_layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", tokens_per_page=4)


def test_allocate_free_and_refcounts():
    a = PageAllocator(4)
    pages = a.allocate(3)
    assert len(set(pages)) == 3 and a.num_used == 3
    a.share(pages[:1])
    a.free(pages)
    assert a.num_used == 1 and a.refcount(pages[0]) == 1
    a.free(pages[:1])
    assert a.num_used == 0


def test_out_of_pages_changes_nothing():
    a = PageAllocator(4)
    held = a.allocate(3)
    before = (list(a._free), list(a._refs))
    with pytest.raises(OutOfPages) as e:
        a.allocate(2)
    assert "2" in str(e.value) and "1 free" in str(e.value)
    assert (list(a._free), list(a._refs)) == before
    a.free(held)


def test_freeing_a_page_twice_is_refused():
    a = PageAllocator(2)
    p = a.allocate(1)
    a.free(p)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(p)


def test_engine_admit_out_of_pages_leaves_pool_as_it_was(default_engine):
    e = default_engine
    huge = e.new_sequence("big", [1] * 100, SamplingParams(max_tokens=8000))
    blockers = []
    while e.allocator.can_allocate(e.cache.layout.pages_for(huge.budget)):
        blockers.append(e.allocator.allocate(50))
    used_before = e.allocator.num_used
    with pytest.raises(OutOfPages):
        e.admit(huge)
    assert e.allocator.num_used == used_before and huge.page_table == []
    for b in blockers:
        e.allocator.free(b)
    assert e.allocator.num_used == 0


def test_write_by_slot_and_gather_by_page():
    cache = KVCache(LAYOUT, num_pages=3)
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)  # [T, Hkv, hd]
    slots = torch.tensor([9, 2, 5])  # page 2 row 1, page 0 row 2, page 1 row 1
    cache.write(1, k, -k, slots)
    kc, vc = cache.gather_pages(1, torch.tensor([[2, 0, 1]]))  # [1, 12, Hkv, hd]
    assert torch.equal(kc[0, [1, 6, 9]], k) and torch.equal(vc[0, [1, 6, 9]], -k)
    assert cache.data[0].abs().sum() == 0  # layer 0 untouched


def test_shared_pool_is_owner_only_and_visible_to_another_process():
    cache = KVCache(LAYOUT, num_pages=3, shared=True)
    name = cache.shm.name
    try:
        mode = stat.S_IMODE(os.stat(cache.shm.path).st_mode)
        assert mode == 0o600
        code = ("import torch; from engine.shm_region import SharedBuffer; "
                f"b = SharedBuffer.attach({name!r}, {cache.shm.size}); "
                "t = b.tensor(torch.float32, (-1,)); t[:4] = 7.0")
        subprocess.run([sys.executable, "-c", code], check=True)
        assert cache.data.flatten()[:4].tolist() == [7.0] * 4
        assert name in our_segments()
    finally:
        cache.close()
    assert name not in our_segments()
