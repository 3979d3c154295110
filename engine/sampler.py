"""The sampler: logits to token ids, per request (its SamplingParams live in tandem/sampling_params.py).

Randomness is counter-based: the draw for output token `n` of a request uses a generator seeded from
(seed, n). A seeded request therefore samples the same tokens whatever batch it runs in, and a
request can move between processes (prefill samples token 0, decode the rest) with nothing to carry
but its seed.
"""

from __future__ import annotations

import torch

from tandem.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive steps far apart


def _generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * _SEED_MIX + step) % (2**63))
    return g


@torch.inference_mode()
def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           banned: list[tuple[int, ...]]) -> tuple[list[int], list[float] | None]:
    """logits: [B, V] -> one token id per row, plus logprobs when any row asks for them.

    `steps[i]` is how many tokens row i has generated so far (the counter for its random draw);
    `banned[i]` are token ids row i may not produce yet (EOS before min_tokens).
    """
    logits = logits.float()  # [B, V]
    for i, ban in enumerate(banned):
        if ban:
            logits[i, list(ban)] = float("-inf")
    tokens = logits.argmax(dim=-1)  # [B]
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, steps[i])
    want_lp = any(p.logprobs for p in params)
    logprobs = None
    if want_lp:
        lp = torch.log_softmax(logits, dim=-1)  # [B, V]
        logprobs = lp.gather(1, tokens[:, None]).squeeze(1).tolist()
    return tokens.tolist(), logprobs


def _sample_row(row: torch.Tensor, p: SamplingParams, step: int) -> int:
    """row: [V] logits -> a token drawn after temperature, top-k and top-p."""
    scaled = row / p.temperature  # [V]
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [V]
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)  # [V], [V]
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    g = _generator(p.seed if p.seed is not None else 0, step, row.device)
    return int(torch.multinomial(probs, 1, generator=g))
