"""Timing our PyTorch engine's passes for `tandem profile` (torch and the engine are imported by callers).

Every measurement is the minimum over its repeats: on a shared machine interference only ever adds
time, and the simulator models a worker that has its cores to itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tandem.sampling_params import SamplingParams  # moving to tandem.sampling_params (same constructor)

# Enough output room for every decode point that reuses a sequence; EOS must not end it early.
_PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Minimum wall time of `repeats` calls of fn, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _random_prompt(engine, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, engine.cfg.vocab_size, (n,), generator=gen).tolist()


def prefill_pass(engine, tokens: int, sequences: int, gen: torch.Generator, keep: bool = False):
    """One packed prefill pass of `sequences` prompts of tokens // sequences tokens each.

    Returns (seconds, sequences); the sequences keep their pages when `keep` (for decode points),
    else they are released.
    """
    n = tokens // sequences
    seqs = [engine.new_sequence(f"p{i}", _random_prompt(engine, n, gen), _PARAMS) for i in range(sequences)]
    for s in seqs:
        engine.admit(s)
    t0 = time.perf_counter()
    engine.prefill(seqs)
    seconds = time.perf_counter() - t0
    if not keep:
        for s in seqs:
            engine.release(s)
        seqs = []
    return seconds, seqs


def time_prefill(engine, tokens: int, sequences: int, repeats: int, gen: torch.Generator) -> float:
    """Best pass time over `repeats` fresh passes of the shape."""
    return min(prefill_pass(engine, tokens, sequences, gen)[0] for _ in range(repeats))


def decode_set(engine, count: int, context: int, gen: torch.Generator, pass_tokens: int,
               record: Callable[[int, int, float], None]) -> list:
    """`count` sequences with `context`-token prompts, prefilled in packed passes of <= pass_tokens
    tokens; each pass's time is handed to record(tokens, sequences, seconds) as a prefill point."""
    per_pass = max(1, pass_tokens // context)
    seqs = []
    while len(seqs) < count:
        k = min(per_pass, count - len(seqs))
        seconds, made = prefill_pass(engine, k * context, k, gen, keep=True)
        record(k * context, k, seconds)
        seqs += made
    return seqs


def time_decode(engine, seqs: list, repeats: int) -> tuple[int, float]:
    """(context tokens, best step time) of decode steps over `seqs`, after one warm-up step."""
    engine.decode_step(seqs)
    context = sum(s.num_tokens for s in seqs)  # what the next step attends to, its new tokens included
    return context, best_of(lambda: engine.decode_step(seqs), repeats)


def release_all(engine, seqs: list) -> None:
    for s in seqs:
        engine.release(s)


def handoff_memcpy_gbps(engine, pages: int, repeats: int) -> float:
    """GB/s of copying `pages` KV pages of every layer between two tensors of the pool's layout.

    A stand-in for the handoff: the same bytes, one process, no transport (shm or NIXL measure
    close to this on one host; scripts/bench_handoff.py measures the real ones).
    """
    layout = engine.cache.layout
    dtype = engine.cache.data.dtype
    shape = (layout.num_layers, 2, pages, layout.tokens_per_page, layout.num_kv_heads, layout.head_dim)
    src = torch.randn(shape).to(dtype)  # [layers, 2, pages, tpp, kv_heads, head_dim]
    dst = torch.zeros((layout.num_layers, 2, 2 * pages) + shape[3:], dtype=dtype)  # a pool twice as big
    src_ids = torch.randperm(pages)
    dst_ids = torch.randperm(2 * pages)[:pages]  # scattered destination pages, as reserved pages are

    def copy() -> None:
        for layer in range(layout.num_layers):  # layer by layer, as a prefill pass writes them
            dst[layer, :, dst_ids] = src[layer, :, src_ids]

    copy()  # first touch of the destination
    nbytes = src.numel() * src.element_size()
    return nbytes / best_of(copy, repeats) / 1e9
