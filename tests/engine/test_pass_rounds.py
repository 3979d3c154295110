"""A pass of more rows than one call takes runs as rounds of one call each (engine/passes.py: `rounds`; engine/engine.py:
`Engine._pass`, `Engine._direct`): a prompt's K/V, first token and prompt log-probs are the same bits
whatever prompts share its pass, whether its K/V go to the local pool or straight to a writer, and
however long the pass is. A round given up leaves every sequence where it was. So a sequence prefilled
again with its outputs (a resume after a failure) goes on with the bits it had."""

from __future__ import annotations

import pytest
import torch

from engine.attention import PassStopped, PoolWriter
from engine.cpu_kernels import build
from engine.cpu_kernels import layers as cpu_layers
from engine.passes import rounds
from engine.kv_pool import KVCache
from engine.load import load_engine
from tandem.sampling_params import SamplingParams

TEXTS = ["Name three rivers of Europe.", "What is a prime number? Answer briefly.", "Count to four:"]


def test_rounds_cut_a_pass_in_order_and_keep_sequences_whole_when_asked():
    assert rounds([3, 4], 8) == [[(0, 0, 3), (1, 0, 4)]]
    assert rounds([5, 6, 2], 8) == [[(0, 0, 5), (1, 0, 3)], [(1, 3, 3), (2, 0, 2)]]
    assert rounds([20], 8) == [[(0, 0, 8)], [(0, 8, 8)], [(0, 16, 4)]]
    assert rounds([5, 6, 2], 8, split=False) == [[(0, 0, 5)], [(1, 0, 6), (2, 0, 2)]]
    assert rounds([3, 20, 1], 8, split=False) == [[(0, 0, 3)], [(1, 0, 20)], [(2, 0, 1)]]
    for counts in ([1] * 17, [8, 8, 8], [7, 9, 30, 1]):
        for split in (True, False):
            got = rounds(counts, 8, split)
            per_seq = {}
            for part in got:
                assert not split or sum(n for _, _, n in part) <= 8
                for i, offset, n in part:
                    assert offset == per_seq.get(i, 0)  # each sequence's rows in order, none twice
                    per_seq[i] = offset + n
            assert per_seq == dict(enumerate(counts))


needs_kernel = pytest.mark.skipif(build.load() is None,
                                       reason="the one-call pass needs the built kernels (AVX-512 or AVX2)")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request):
    return load_engine("smollm2-135m", dtype=request.param, kv_bytes=64 << 20)


def test_fp32_runs_long_passes_in_rounds_and_bf16_in_the_layer_loop_where_onednn_multiplies_it(engine):
    """With AVX-512, bf16's loop has oneDNN's products past 16 rows, twice as fast as the one call's; with
    AVX2 there are none and bf16 runs in rounds as fp32 does (layers.py)."""
    rounds_dtypes = (torch.float32,) if build.isa() == "avx512" else (torch.float32, torch.bfloat16)
    assert engine.model.in_rounds == (engine.model.dtype in rounds_dtypes and engine.model.one_call_rows > 0)


def _calls(monkeypatch) -> list[int]:
    calls, real = [], cpu_layers.run_pass
    monkeypatch.setattr(cpu_layers, "run_pass", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    return calls


def _prefill(engine, prompts: list[list[int]], direct: bool = False):
    """Prefill the prompts in one call of `Engine.prefill` (into the pool, or `direct` into writers, each
    another pool) -> (sequences, each one's K/V [layers, 2, n, Hkv, hd])."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=True, top_logprobs=2)
    seqs = [engine.new_sequence(f"p{i}", ids, params) for i, ids in enumerate(prompts)]
    if direct:
        others = [KVCache(engine.kv_layout(), -(-len(ids) // engine.tokens_per_page)) for ids in prompts]
        engine.prefill(seqs, [PoolWriter(o, torch.arange(len(ids))) for o, ids in zip(others, prompts)])
        return seqs, [o.data.flatten(2, 3)[:, :, :len(ids)] for o, ids in zip(others, prompts)]
    for s in seqs:
        engine.admit(s)
    engine.prefill(seqs)
    kv = [engine.cache.data[:, :, s.page_table].flatten(2, 3)[:, :, :len(s.prompt_ids)].clone() for s in seqs]
    for s in seqs:
        engine.release(s)
    return seqs, kv


def _same(a, b, ka, kb) -> None:
    for x, y, kx, ky in zip(a, b, ka, kb):
        assert x.output_ids == y.output_ids and torch.equal(kx, ky) and kx.abs().sum() > 0
        assert [r.logprob for r in x.prompt_logprobs] == [r.logprob for r in y.prompt_logprobs]


@needs_kernel
def test_a_pass_past_the_limit_runs_in_rounds_with_the_bits_of_one_call(engine, monkeypatch):
    """Three prompts, a call limited to the longest one's rows: into the pool the pass runs as rounds
    cutting prompts where the limit falls, straight to writers as rounds of whole prompts; both give
    each prompt the bits it has in a pass of its own."""
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    lens = list(map(len, prompts))
    calls = _calls(monkeypatch)
    alone = [_prefill(engine, [p]) for p in prompts]
    assert calls == lens  # each alone in one call
    alone_seqs, alone_kv = [seqs[0] for seqs, _ in alone], [kv[0] for _, kv in alone]
    monkeypatch.setitem(cpu_layers.ONE_CALL_ROWS, engine.model.dtype, max(lens))
    monkeypatch.setattr(cpu_layers, "IN_ROUNDS", {engine.model.dtype})  # bf16 keeps the loop past its limit
    calls.clear()
    packed, packed_kv = _prefill(engine, prompts)
    assert calls == [sum(n for _, _, n in part) for part in rounds(lens, max(lens))] and len(calls) >= 2
    assert any(len(part) > 1 for part in rounds(lens, max(lens)))  # some round cuts a prompt: [0, a) then [a, n)
    _same(packed, alone_seqs, packed_kv, alone_kv)
    calls.clear()
    direct, direct_kv = _prefill(engine, prompts, direct=True)
    assert calls == [sum(n for _, _, n in part) for part in rounds(lens, max(lens), split=False)]
    _same(direct, alone_seqs, direct_kv, alone_kv)
    longest = lens.index(max(lens))  # past the limit now: a round of its own in the layer loop
    monkeypatch.setitem(cpu_layers.ONE_CALL_ROWS, engine.model.dtype, max(lens) - 1)
    calls.clear()
    direct, direct_kv = _prefill(engine, prompts, direct=True)
    assert calls == [n for part in rounds(lens, max(lens) - 1, split=False)
                     for n in [sum(x[2] for x in part)] if n < max(lens)] and max(lens) not in calls
    keep = [i for i in range(len(prompts)) if i != longest]
    _same(*([x[i] for i in keep] for x in (direct, alone_seqs, direct_kv, alone_kv)))
    assert direct[longest].output_ids == alone_seqs[longest].output_ids  # the loop: within rounding


@needs_kernel
def test_a_round_given_up_leaves_every_sequence_where_it_was(engine, monkeypatch):
    """Three prompts in rounds of the longest one's rows; the requests go away during the second round:
    PassStopped, no sequence has advanced or taken a token, and the same pass run again gives the bits
    of one undisturbed."""
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    monkeypatch.setitem(cpu_layers.ONE_CALL_ROWS, engine.model.dtype, max(map(len, prompts)))
    monkeypatch.setattr(cpu_layers, "IN_ROUNDS", {engine.model.dtype})
    calls = _calls(monkeypatch)
    want, want_kv = _prefill(engine, prompts)
    calls.clear()
    seqs = [engine.new_sequence(f"s{i}", ids, SamplingParams(max_tokens=1, prompt_logprobs=True, top_logprobs=2))
            for i, ids in enumerate(prompts)]
    for s in seqs:
        engine.admit(s)
    with pytest.raises(PassStopped):
        engine.prefill(seqs, stop=lambda: len(calls) >= 2)
    assert len(calls) == 2 and all(s.num_cached == 0 and not s.output_ids for s in seqs)
    engine.prefill(seqs)
    kv = [engine.cache.data[:, :, s.page_table].flatten(2, 3)[:, :, :len(s.prompt_ids)].clone() for s in seqs]
    for s in seqs:
        engine.release(s)
    _same(seqs, want, kv, want_kv)


@needs_kernel
@pytest.mark.parametrize("limit", [None, 7], ids=["one-call", "rounds-of-7"])
def test_a_sequence_prefilled_again_with_its_outputs_goes_on_with_the_same_bits(monkeypatch, limit):
    """What a resume after a failure does: a new worker prefills the prompt plus the tokens already
    streamed and decodes on. fp32, sampled (temperature 0.8, a seed): it draws exactly the tokens of the
    undisturbed run, with the same log-probs bit for bit, and holds the same K/V (the decode rows' K/V
    recomputed as prompt rows, in one call or in rounds)."""
    engine = load_engine("smollm2-135m", dtype="float32", kv_bytes=64 << 20)
    if limit is not None:
        monkeypatch.setitem(cpu_layers.ONE_CALL_ROWS, torch.float32, limit)
    ids = engine.tokenizer.encode(TEXTS[1])
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7, logprobs=True, ignore_eos=True)

    def run(seq):
        engine.admit(seq)
        engine.prefill([seq])
        while len(seq.output_ids) < params.max_tokens:
            engine.decode_step([seq])
        kv = engine.cache.data[:, :, seq.page_table].flatten(2, 3)[:, :, :seq.num_tokens - 1].clone()
        engine.release(seq)
        return kv

    whole = engine.new_sequence("whole", ids, params)
    whole_kv = run(whole)
    resumed = engine.new_sequence("resumed", ids, params, output_ids=whole.output_ids[:5])
    resumed_kv = run(resumed)
    assert resumed.output_ids == whole.output_ids
    assert resumed.output_logprobs == whole.output_logprobs[5:]  # the 7 it drew itself
    assert torch.equal(resumed_kv, whole_kv)
