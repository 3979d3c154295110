"""Decode on static, padded buffers (the path CUDA graphs replay), run eagerly here: the same greedy
tokens as the ordinary decode path, whatever the batch's padding and page width, and no page outside
the batch is written. The graphs themselves are checked on a GPU (tests/engine/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.kv_pool import KVCache
from engine.load import load_engine
from engine.tokenizer import ChatMessage
from tandem.sampling_params import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Count from one to five.",
           "Name a color.", "Why is the sky blue? Answer in one long sentence, please."]


def _run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens)
    seqs = [engine.new_sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.admit(s)
    engine.prefill(seqs)
    while not all(s.finished for s in seqs):
        engine.decode_step([s for s in seqs if not s.finished])  # the batch shrinks as rows finish
    for s in seqs:
        engine.release(s)
    return [s.output_ids for s in seqs]


def test_padded_static_decode_equals_the_ordinary_path(default_engine):
    prompts = [default_engine.tokenizer.encode_chat([ChatMessage("user", p)]) for p in PROMPTS]
    plain = Engine(default_engine.model, default_engine.tokenizer, KVCache(default_engine.cache.layout, 64))
    padded = Engine(default_engine.model, default_engine.tokenizer, KVCache(default_engine.cache.layout, 64))
    padded.use_decode_graphs((1, 2, 8), capture=False)  # 5 rows run padded to 8, 2 rows as 2, 1 as 1
    expected = _run_batch(plain, prompts, 12)
    padded.cache.data[:, :, 40:] = 7.0  # pages the batch never holds (it needs fewer than 40)
    assert _run_batch(padded, prompts, 12) == expected
    assert bool((padded.cache.data[:, :, 40:] == 7.0).all()), "a padded step wrote outside the batch's pages"
    shapes = sorted(padded.graphs._steps)
    assert {b for b, _ in shapes} >= {8}, shapes
    assert all(p & (p - 1) == 0 for _, p in shapes), shapes


def test_batches_larger_than_the_largest_size_run_eagerly(default_engine):
    prompts = [default_engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    plain = Engine(default_engine.model, default_engine.tokenizer, KVCache(default_engine.cache.layout, 32))
    small = Engine(default_engine.model, default_engine.tokenizer, KVCache(default_engine.cache.layout, 32))
    small.use_decode_graphs((2,), capture=False)
    assert _run_batch(small, prompts, 6) == _run_batch(plain, prompts, 6)
    assert small.graphs._steps == {} or all(b == 2 for b, _ in small.graphs._steps)


def test_page_width_is_a_power_of_two_capped_by_the_context(default_engine):
    e = Engine(default_engine.model, default_engine.tokenizer, KVCache(default_engine.cache.layout, 8))
    e.use_decode_graphs((1,), capture=False)
    g = e.graphs
    assert [g.page_width(n) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]
    assert g.page_width(10 ** 6) == g.max_pages


def test_cuda_graphs_are_refused_where_they_cannot_run():
    with pytest.raises(ModelLoadError, match="CUDA device"):
        load_engine("smollm2-135m", kv_bytes=8 << 20, cuda_graphs=True)
    with pytest.raises(ModelLoadError, match="cuda_graphs must be"):
        load_engine("smollm2-135m", kv_bytes=8 << 20, cuda_graphs="yes")


def test_auto_dtype_is_float32_on_cpu_and_graphs_stay_off():
    engine = load_engine("smollm2-135m", kv_bytes=8 << 20)
    assert engine.model.dtype == torch.float32 and engine.cache.data.dtype == torch.float32
    assert engine.graphs is None
