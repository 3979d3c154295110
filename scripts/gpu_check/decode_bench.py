"""Engine throughput on the device: decode tokens/s per batch size, with and without CUDA graphs, as
a fraction of the memory roofline; prefill tokens/s as a fraction of the measured matmul rate.

Decode roofline: a step must read every weight once and each sequence's K/V once, so it cannot be
faster than (weight bytes + K/V bytes) / copy bandwidth. Prefill ceiling: its matmuls do
2 x (linear weights) flops per token; attention's share is added from each prompt's length.
"""

from __future__ import annotations

import time

import torch

from engine.engine import Engine
from scripts.gpu_check.device_rates import sync
from tandem.sampling_params import SamplingParams


def _sequences(engine: Engine, batch: int, prompt_len: int, max_tokens: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.cfg.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = []
    for i in range(batch):
        ids = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        seq = engine.new_sequence(f"b{i}", ids, params)
        engine.admit(seq)
        seqs.append(seq)
    return seqs


def _kv_bytes_per_step(engine: Engine, seqs: list) -> int:
    lay = engine.cache.layout
    per_token = lay.num_layers * 2 * lay.num_kv_heads * lay.head_dim * engine.cache.data.element_size()
    return sum(s.num_tokens for s in seqs) * per_token


def decode_rate(engine: Engine, batch: int, steps: int, prompt_len: int, copy_gbps: float,
                graphs: bool, prefill_chunk: int = 32) -> dict:
    """Tokens/s of `steps` decode steps of `batch` sequences (each step ends with the sampled tokens
    on the host), after 3 warm-up steps (graph capture happens there)."""
    saved = engine.graphs
    if not graphs:
        engine.graphs = None
    elif saved is None:
        return {"skipped": "this engine has no CUDA graphs"}
    seqs = _sequences(engine, batch, prompt_len, steps + 4)
    try:
        for i in range(0, batch, prefill_chunk):
            engine.prefill(seqs[i:i + prefill_chunk])
        for _ in range(3):
            engine.decode_step(seqs)
        sync(engine.device)
        kv_start = _kv_bytes_per_step(engine, seqs)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.decode_step(seqs)
        elapsed = time.perf_counter() - t0
    finally:
        for s in seqs:
            engine.release(s)
        engine.graphs = saved
    step_s = elapsed / steps
    kv_bytes = (kv_start + _kv_bytes_per_step(engine, seqs)) // 2  # contexts grow a token a step: mid-run
    floor_s = (engine.model.weight_bytes + kv_bytes) / (copy_gbps * 1e9)
    return {"batch": batch, "graphs": graphs, "tokens_per_s": round(batch / step_s, 1),
            "step_ms": round(step_s * 1e3, 3), "bytes_per_step": engine.model.weight_bytes + kv_bytes,
            "roofline_fraction": round(floor_s / step_s, 3)}


def linear_flops_per_token(engine: Engine) -> int:
    """2 x the weights every token multiplies through (the output head runs on last rows only)."""
    return 2 * sum(d.out_features * d.in_features for L in engine.model.layers for d in (L.qkv, L.o, L.gate_up, L.down))


def prefill_rate(engine: Engine, prompts: int, prompt_len: int, matmul_tflops: float, repeat: int = 3) -> dict:
    """Tokens/s of one packed prefill pass of `prompts` prompts of `prompt_len` tokens."""
    c = engine.cfg
    attn_flops = 4 * c.num_layers * c.num_heads * c.head_dim * (prompt_len + 1) // 2  # per token, causal
    flops_per_token = linear_flops_per_token(engine) + attn_flops
    times = []
    for r in range(repeat + 1):  # the first pass warms up
        seqs = _sequences(engine, prompts, prompt_len, 1, seed=r)
        try:
            sync(engine.device)
            t0 = time.perf_counter()
            engine.prefill(seqs)
            sync(engine.device)
            times.append(time.perf_counter() - t0)
        finally:
            for s in seqs:
                engine.release(s)
    s = min(times[1:])
    tokens = prompts * prompt_len
    achieved = tokens * flops_per_token / s / 1e12
    return {"prompts": prompts, "prompt_len": prompt_len, "tokens_per_s": round(tokens / s, 1),
            "tflops": round(achieved, 2), "matmul_fraction": round(achieved / matmul_tflops, 3)}
