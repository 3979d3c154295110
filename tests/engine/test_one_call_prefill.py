"""A prompt pass of up to `one_call_rows` rows runs every layer in one call (engine/cpu_kernels/layers.py): each prompt row
attends over the pool up to its own position with the decode kernel, where the layer loop runs PyTorch's
causal attention. The two agree within the dtype's rounding (K/V written and every position's
log-probs) with the same greedy tokens; a prompt's bits do not depend on the prompts packed beside it;
a chunk continuing cached pages sees them; prompts sent straight to writers give the pooled bits; writers get each layer's K/V while the later layers compute,
a pass whose requests went away stops between two layers, and the pass leaves the GIL to other threads."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from engine.attention import PassStopped, PoolWriter
from engine.cpu_kernels import build
from engine.cpu_kernels import layers as cpu_layers
from engine.kv_pool import KVCache
from engine.load import load_engine
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(build.load() is None,
                                reason="the one-call pass needs the built kernels (AVX-512 or AVX2)")
TEXTS = ["Name three rivers of Europe.", "What is a prime number? Answer briefly."]  # 15 rows: bf16 takes 16
# bf16: one rounding step of 2^-8 apart per layer, compounded over 30 layers (seen: K/V 1 ulp apart on
# average, 0.15 at most where values reach 18; log-probs 0.06 at most)
TOL = {"float32": dict(atol=1e-4, rtol=1e-4), "bfloat16": dict(atol=0.25, rtol=0.05)}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request):
    return load_engine("smollm2-135m", dtype=request.param, kv_bytes=64 << 20)


def _prefill(engine, prompts: list[list[int]], together: bool):
    """Prefill the prompts (one pass, or one pass each) -> (sequences, each one's K/V [layers, 2, n, Hkv, hd])."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=True, top_logprobs=2)
    seqs = [engine.new_sequence(f"p{i}", ids, params) for i, ids in enumerate(prompts)]
    for s in seqs:
        engine.admit(s)
    for group in [seqs] if together else [[s] for s in seqs]:
        engine.prefill(group)
    pool = engine.cache.data  # [layers, 2, pages, tpp, Hkv, hd]
    kv = [pool[:, :, s.page_table].flatten(2, 3)[:, :, :len(s.prompt_ids)].clone() for s in seqs]
    for s in seqs:
        engine.release(s)
    return seqs, kv


def test_one_call_equals_the_layer_loop_within_rounding_and_ignores_its_neighbours(engine, monkeypatch):
    dtype = str(engine.model.dtype).removeprefix("torch.")
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    assert sum(map(len, prompts)) <= engine.model.one_call_rows
    calls, real = [], cpu_layers.run_pass
    monkeypatch.setattr(cpu_layers, "run_pass", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    packed, packed_kv = _prefill(engine, prompts, together=True)
    alone, alone_kv = _prefill(engine, prompts, together=False)
    assert calls == [sum(map(len, prompts)), *map(len, prompts)]  # every pass went through the one call
    for a, b, ka, kb in zip(packed, alone, packed_kv, alone_kv):
        assert torch.equal(ka, kb) and a.output_ids == b.output_ids
        assert [r.logprob for r in a.prompt_logprobs] == [r.logprob for r in b.prompt_logprobs]
    monkeypatch.setattr(engine.model, "_one_call", None)  # the layer loop, causal SDPA
    loop, loop_kv = _prefill(engine, prompts, together=True)
    assert len(calls) == 3
    for a, b, ka, kb in zip(packed, loop, packed_kv, loop_kv):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(ka.float(), kb.float(), **TOL[dtype])
        assert (ka.float() - kb.float()).abs().mean() <= 0.02 * ka.float().abs().mean()
        torch.testing.assert_close(torch.tensor([r.logprob for r in a.prompt_logprobs]),
                                   torch.tensor([r.logprob for r in b.prompt_logprobs]), **TOL[dtype])


def test_a_chunk_after_cached_pages_attends_to_them(engine):
    """The prompt computed as 3 tokens then the rest (both passes in one call) gives what one pass does."""
    ids = engine.tokenizer.encode(TEXTS[1])
    (whole,), (whole_kv,) = _prefill(engine, [ids], together=True)
    seq = engine.new_sequence("c", ids, SamplingParams(max_tokens=1, prompt_logprobs=True, top_logprobs=2))
    engine.admit(seq)
    engine.extend([seq], [3])
    engine.extend([seq], [len(ids) - 3])
    kv = engine.cache.data[:, :, seq.page_table].flatten(2, 3)[:, :, :len(ids)].clone()
    engine.release(seq)
    assert seq.output_ids == whole.output_ids
    assert torch.equal(kv, whole_kv)  # each row's bits whatever pass it was in
    assert [r.logprob for r in seq.prompt_logprobs] == [r.logprob for r in whole.prompt_logprobs]


def test_writers_get_every_layers_new_kv_after_a_pass_in_one_call(engine, monkeypatch):
    """A prompt chunk continued against the pool and also sent to a writer (the prefill worker's pooled
    path): the writer, here another pool, ends with the same K/V as the engine's own pages."""
    ids = engine.tokenizer.encode(TEXTS[1])
    calls, real = [], cpu_layers.run_pass
    monkeypatch.setattr(cpu_layers, "run_pass", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    other = KVCache(engine.kv_layout(), engine.cache.num_pages)
    seq = engine.new_sequence("w", ids, SamplingParams(max_tokens=1))
    engine.admit(seq)
    tpp = engine.tokens_per_page
    slots = torch.tensor([seq.page_table[p // tpp] * tpp + p % tpp for p in range(len(ids))])
    engine.extend([seq], [len(ids)], [PoolWriter(other, slots)])
    mine = engine.cache.data[:, :, seq.page_table].flatten(2, 3)[:, :, :len(ids)]
    theirs = other.data[:, :, seq.page_table].flatten(2, 3)[:, :, :len(ids)]
    engine.release(seq)
    assert calls == [len(ids)] and torch.equal(mine, theirs) and mine.abs().sum() > 0


def test_prompts_straight_to_writers_give_the_pooled_bits(engine, monkeypatch):
    """The prefill worker's direct path (no pages in its own pool: the pool was full, or it keeps no
    cache) runs in one call too, over pages made for the pass: each writer, here another pool, ends with
    the K/V a pooled prefill leaves in the engine's pages, and the first tokens and prompt log-probs are
    the same bits; whether the worker had room no longer changes an answer's rounding."""
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    calls, real = [], cpu_layers.run_pass
    monkeypatch.setattr(cpu_layers, "run_pass", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    pooled, pooled_kv = _prefill(engine, prompts, together=True)
    params = SamplingParams(max_tokens=1, prompt_logprobs=True, top_logprobs=2)
    seqs = [engine.new_sequence(f"d{i}", ids, params) for i, ids in enumerate(prompts)]
    others = [KVCache(engine.kv_layout(), -(-len(ids) // engine.tokens_per_page)) for ids in prompts]
    writers = [PoolWriter(o, torch.arange(len(ids))) for o, ids in zip(others, prompts)]  # slot p: position p
    engine.prefill(seqs, writers)
    assert calls == [sum(map(len, prompts))] * 2  # both passes in one call
    for s, p, o, kv, ids in zip(seqs, pooled, others, pooled_kv, prompts):
        assert not s.page_table and s.output_ids == p.output_ids
        assert [r.logprob for r in s.prompt_logprobs] == [r.logprob for r in p.prompt_logprobs]
        assert torch.equal(o.data.flatten(2, 3)[:, :, :len(ids)], kv) and kv.abs().sum() > 0


def test_a_pass_mixing_a_decode_row_and_a_prompt_chunk_gives_each_its_own_bits(engine, monkeypatch):
    """Chunked scheduling packs decode rows and a prompt chunk into one pass: in one call each row gives
    the same bits as in a pass of its own (the next token's log-prob, and the chunk's K/V)."""
    calls, real = [], cpu_layers.run_pass
    monkeypatch.setattr(cpu_layers, "run_pass", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    params = SamplingParams(max_tokens=2, logprobs=True)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]

    def run(together: bool):
        a, b = (engine.new_sequence(f"{n}{together}", i, params) for n, i in zip("ab", ids))
        for s in (a, b):
            engine.admit(s)
        engine.prefill([a])  # a's first token; its next pass is a decode row
        engine.extend([b], [3])  # b's first chunk; the rest comes with a's decode row
        rest = len(ids[1]) - 3
        if together:
            engine.extend([a, b], [1, rest])
        else:
            engine.extend([a], [1])
            engine.extend([b], [rest])
        kv = engine.cache.data[:, :, b.page_table].flatten(2, 3)[:, :, :len(ids[1])].clone()
        for s in (a, b):
            engine.release(s)
        return a.output_logprobs, b.output_logprobs, kv

    together, apart = run(True), run(False)
    assert calls == [len(ids[0]), 3, 1 + len(ids[1]) - 3, len(ids[0]), 3, 1, len(ids[1]) - 3]
    assert together[0] == apart[0] and together[1] == apart[1] and torch.equal(together[2], apart[2])


def test_a_prompt_as_long_as_the_limit_runs_in_one_call_and_chunks_give_the_same_bits(engine, monkeypatch):
    """A prompt as long as the one-call limit (fp32 1024 rows; bf16 16 with AVX-512, 1024 with AVX2): the
    whole prompt against the layer loop (within rounding, same greedy token), and the prompt in two chunks
    against it in one pass (bit for bit)."""
    rows = engine.model.one_call_rows
    ids = (engine.tokenizer.encode(" ".join(TEXTS)) * rows)[:rows]
    calls, real = [], cpu_layers.run_pass
    monkeypatch.setattr(cpu_layers, "run_pass", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    (whole,), (whole_kv,) = _prefill(engine, [ids], together=True)
    seq = engine.new_sequence("c", ids, SamplingParams(max_tokens=1, prompt_logprobs=True, top_logprobs=2))
    engine.admit(seq)
    engine.extend([seq], [rows // 3])
    engine.extend([seq], [rows - rows // 3])
    chunked_kv = engine.cache.data[:, :, seq.page_table].flatten(2, 3)[:, :, :rows].clone()
    engine.release(seq)
    assert calls == [rows, rows // 3, rows - rows // 3]
    assert torch.equal(chunked_kv, whole_kv) and seq.output_ids == whole.output_ids
    assert [r.logprob for r in seq.prompt_logprobs] == [r.logprob for r in whole.prompt_logprobs]
    monkeypatch.setattr(engine.model, "_one_call", None)
    (loop,), (loop_kv,) = _prefill(engine, [ids], together=True)
    assert len(calls) == 3 and loop.output_ids == whole.output_ids
    dtype = str(engine.model.dtype).removeprefix("torch.")
    if rows <= 16 or engine.model.dtype == torch.float32:
        torch.testing.assert_close(whole_kv.float(), loop_kv.float(), **TOL[dtype])
    else:  # a bf16 prompt of 1024 rows (AVX2): the two arithmetics' bf16 roundings compound over 30 layers
        a, b = whole_kv.float(), loop_kv.float()  # [layers, 2, rows, kv heads, head dim]
        outside = ~torch.isclose(a, b, **TOL[dtype])
        assert outside.float().mean() < 1e-4, f"{int(outside.sum())} of {a.numel()} K/V values differ"
        assert (a - b).abs().mean() <= 0.02 * a.abs().mean()
    torch.testing.assert_close(torch.tensor([r.logprob for r in whole.prompt_logprobs]),
                               torch.tensor([r.logprob for r in loop.prompt_logprobs]), **TOL[dtype])


class _Watcher(PoolWriter):
    """A writer into the engine's own pool that notes, for each layer it is given, whether that layer's
    K/V are already in the pool and the next layer's are not yet (the pages were filled with NaN)."""

    def __init__(self, cache: KVCache, slots: torch.Tensor):
        super().__init__(cache, slots)
        self.seen: list[tuple[int, bool, bool]] = []  # (layer, its K/V in the pool, the next layer's still NaN)

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        flat = self.cache.data.flatten(2, 3)  # [layers, 2, pages * tpp, Hkv, hd]
        slots = self.slots[start:start + k.shape[0]]
        here = torch.equal(flat[layer, 0, slots], k) and torch.equal(flat[layer, 1, slots], v)
        later = layer + 1 == flat.shape[0] or bool(flat[layer + 1, :, slots].isnan().all())
        self.seen.append((layer, here, later))


def _watched_chunk(engine, stop_after: int | None = None):
    """A prompt continued against the pool with a writer watching (the prefill worker's pooled path), its
    pages first filled with NaN; the requests go away once the writer has layer `stop_after` ->
    (the writer's notes, the pass's error or None, the layers whose K/V the pool holds afterwards)."""
    ids = engine.tokenizer.encode(TEXTS[1])
    seq = engine.new_sequence("w", ids, SamplingParams(max_tokens=1))
    engine.admit(seq)
    engine.cache.data[:, :, seq.page_table] = float("nan")
    tpp = engine.tokens_per_page
    watcher = _Watcher(engine.cache, torch.tensor([seq.page_table[p // tpp] * tpp + p % tpp for p in range(len(ids))]))
    stop = None if stop_after is None else (lambda: bool(watcher.seen) and watcher.seen[-1][0] >= stop_after)
    error = None
    try:
        engine.extend([seq], [len(ids)], [watcher], stop=stop)
    except PassStopped as e:
        error = e
    pages = engine.cache.data[:, :, seq.page_table]  # [layers, 2, P, tpp, Hkv, hd]
    computed = [i for i in range(pages.shape[0]) if not pages[i].flatten(1, 2)[:, :len(ids)].isnan().any()]
    engine.release(seq)
    return watcher.seen, error, computed


def test_writers_get_each_layer_before_the_next_is_computed(engine):
    layers = engine.cache.layout.num_layers
    seen, error, computed = _watched_chunk(engine)
    assert error is None and seen == [(i, True, True) for i in range(layers)] and computed == list(range(layers))


def test_a_pass_in_one_call_stops_between_two_layers(engine):
    """The requests go away while layer 2 computes: the writer has layers 0-2, layer 3 is never computed."""
    seen, error, computed = _watched_chunk(engine, stop_after=2)
    assert isinstance(error, PassStopped) and "after layer 2" in str(error)
    assert seen == [(i, True, True) for i in range(3)] and computed == [0, 1, 2]


def test_a_pass_in_one_call_whose_requests_leave_during_its_last_layer_completes(engine):
    """As in the layer loop (checked before each layer): once the last layer is computed the pass is done,
    and giving it up then would only make its live requests compute it again."""
    layers = engine.cache.layout.num_layers
    seen, error, computed = _watched_chunk(engine, stop_after=layers - 1)
    assert error is None and computed == list(range(layers)) and len(seen) == layers


def test_other_python_threads_run_while_a_pass_computes(engine, monkeypatch):
    """With the interpreter's switch interval made huge, a thread waiting for the GIL gets it only when the
    holder lets go of it: woken at layer 0's hand-over, it has run by the last layer's only if the kernel
    released the GIL while it computed (a worker's server and a writer's copies run during a long pass)."""
    layers = engine.cache.layout.num_layers
    woken, ran, seen_at_last = threading.Event(), [], []

    def other():
        woken.wait()
        ran.append(True)

    real = cpu_layers.run_pass

    def run_pass(*args):
        def after_layer(i):
            if i == 0:
                woken.set()
            if i == layers - 1:
                seen_at_last.append(bool(ran))
        return real(*args[:7], after_layer)

    monkeypatch.setattr(cpu_layers, "run_pass", run_pass)
    ids = (engine.tokenizer.encode(" ".join(TEXTS)) * 64)[:engine.model.one_call_rows]
    thread = threading.Thread(target=other)
    thread.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        _prefill(engine, [ids], together=True)
    finally:
        sys.setswitchinterval(interval)
        woken.set()
        thread.join()
    assert seen_at_last == [True]
