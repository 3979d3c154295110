"""Per-request sampling parameters and the sampler.

Randomness is counter-based: the draw for output token `n` of a request uses a generator seeded from
(seed, n). A seeded request therefore samples the same tokens whatever batch it runs in, and a
request can move between processes (prefill samples token 0, decode the rest) with nothing to carry
but its seed.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace

import torch

from engine.errors import InvalidRequest
from tandem.strict import check_keys

MAX_STOP_STRINGS = 16
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive steps far apart


@dataclass(frozen=True)
class SamplingParams:
    """What to generate. temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    extra_eos: tuple[int, ...] = field(default=())  # e.g. a client's end_id, on top of the model's EOS

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = disabled), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings, got {list(self.stop)!r}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidRequest(f"seed must be in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed, so every process that samples for this request agrees."""
        return self if self.seed is not None or self.greedy else replace(self, seed=secrets.randbits(63))

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        check_keys(cls, data, "sampling fields", InvalidRequest)
        data = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()}
        try:
            return cls(**data)
        except TypeError as e:
            raise InvalidRequest(f"bad sampling parameters: {e}") from None


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
