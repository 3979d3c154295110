"""On a CUDA device: the same greedy tokens as transformers in fp32, sensible output in bf16 (the
default there), the KV pool in GPU memory, decode on CUDA graphs equal to eager decode, and a graph
step that neither synchronizes with the host nor writes outside its batch's pages."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.kv_pool import KVCache
from engine.load import load_engine
from tandem.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from tests.conftest import complete
from tests.engine.test_decode_graphs import PROMPTS, _run_batch
from tests.engine.test_exactness import CHAT_PROMPTS

pytestmark = pytest.mark.gpu


def test_fp32_on_cuda_matches_transformers(hf_default_model):
    engine = load_engine("smollm2-135m", device="cuda", dtype="float32", kv_bytes=128 << 20)
    assert engine.graphs is not None, "cuda_graphs='auto' captures decode graphs on CUDA"
    tok, hf = hf_default_model
    hf = hf.to("cuda")
    for p in CHAT_PROMPTS[:4]:
        ids = engine.tokenizer.encode_chat([ChatMessage("user", p)])
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24, do_sample=False,
                              eos_token_id=2, pad_token_id=2)
        assert complete(engine, ids, SamplingParams(max_tokens=24)).output_ids == out[0, len(ids):].tolist()
    hf.to("cpu")


def test_bf16_is_the_default_on_cuda_and_answers_sensibly():
    engine = load_engine("smollm2-135m", device="cuda", kv_bytes=64 << 20)
    assert engine.model.dtype == torch.bfloat16 and engine.cache.layout.dtype == "bfloat16"
    seq = complete(engine, engine.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=4))
    assert "Paris" in engine.tokenizer.decode(seq.output_ids)


def test_the_kv_pool_lives_in_gpu_memory_for_decode_and_prefill_engines():
    decode = load_engine("smollm2-135m", device="cuda", kv_bytes=64 << 20)
    assert decode.cache.data.is_cuda and decode.cache.data.device == decode.device
    prefill = load_engine("smollm2-135m", device="cuda", kv_bytes=None)
    assert prefill.graphs is None, "a prefill-only engine has no decode steps to capture"
    prefill.attach_pool(16)
    assert prefill.cache.data.is_cuda


def test_cuda_graph_decode_equals_eager_decode():
    graphs = load_engine("smollm2-135m", device="cuda", dtype="float32", kv_bytes=64 << 20, cuda_graphs=True)
    eager = Engine(graphs.model, graphs.tokenizer, KVCache(graphs.cache.layout, graphs.cache.num_pages, graphs.device))
    prompts = [graphs.tokenizer.encode_chat([ChatMessage("user", p)]) for p in PROMPTS]
    assert _run_batch(graphs, prompts, 16) == _run_batch(eager, prompts, 16)
    assert any(b == 8 for b, _ in graphs.graphs.captured), "5 rows should have replayed the batch-8 graph"


def test_a_graph_step_neither_synchronizes_nor_writes_outside_its_pages():
    engine = load_engine("smollm2-135m", device="cuda", dtype="bfloat16", kv_bytes=64 << 20)
    ids = engine.tokenizer.encode("The quick brown fox")
    seqs = [engine.new_sequence(f"s{i}", ids, SamplingParams(max_tokens=8)) for i in range(3)]
    for s in seqs:
        engine.admit(s)
    engine.prefill(seqs)
    engine.decode_step(seqs)  # captures the (4, 1) graph
    used = {p for s in seqs for p in s.page_table}
    others = [p for p in range(engine.cache.num_pages) if p not in used]
    engine.cache.data[:, :, others] = 3.0
    args = ([s.all_ids[s.num_cached] for s in seqs], [s.num_cached for s in seqs], [s.page_table for s in seqs])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = engine.graphs.run(*args)  # [3, V], on the device: nothing read back yet
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (3, engine.cfg.vocab_size) and bool(torch.isfinite(logits).all())
    assert bool((engine.cache.data[:, :, others] == 3.0).all())
    for s in seqs:
        engine.release(s)


def test_cuda_graphs_are_refused_for_an_engine_without_a_pool():
    from engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="KV pool"):
        load_engine("smollm2-135m", device="cuda", kv_bytes=None, cuda_graphs=True)
