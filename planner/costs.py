"""Pass and step times the simulator charges, from a profile's fitted models.

Chunks are `(start, n)`: n prompt tokens at positions start .. start+n-1 of one prompt (start 0 for a
whole prompt). Their causal-attention work is (start + n)^2 - start^2 token pairs, so the chunks of a
long prompt cost, in attention, exactly what the whole prompt does in one pass.

A worker spread over several devices divides each phase's time by that phase's speedup. A worker
that streams tokens also pays its served step overhead on every pass (planner/served.py); the
overhead is not divided by the speedup (it is measured on the served worker as it is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.profile import DecodeFit, PrefillFit, Profile
from planner.served import NONE, StepOverhead

Chunk = tuple[int, int]  # (start position, tokens)


@dataclass(frozen=True)
class PassCosts:
    prefill: PrefillFit
    decode: DecodeFit
    prefill_speedup: float = 1.0
    decode_speedup: float = 1.0
    served: StepOverhead = NONE

    @classmethod
    def of(cls, profile: Profile, prefill_speedup: float = 1.0, decode_speedup: float = 1.0,
           served: StepOverhead = NONE) -> "PassCosts":
        """The costs of one worker of `profile` (fitted: see profile.fitted), sped up as given, paying
        `served` on every pass."""
        if profile.prefill.fit is None or profile.decode.fit is None:
            raise ValueError("the profile has no fitted models; read it with load_profile/parse_profile")
        return cls(profile.prefill.fit, profile.decode.fit, prefill_speedup, decode_speedup, served)

    def _prefill_work(self, chunks: list[Chunk]) -> float:
        """Prefill time without its intercept, before the speedup."""
        f = self.prefill
        tokens = sum(n for _, n in chunks)
        attention = sum((s + n) ** 2 - s ** 2 for s, n in chunks)
        return f.per_token_s * tokens + f.per_attention_s * attention + f.per_sequence_s * len(chunks)

    def _decode_work(self, batch: int, context_tokens: int) -> float:
        f = self.decode
        small_batch = math.log2(batch) if batch > 0 else 0.0
        return f.per_sequence_s * batch + f.per_context_token_s * context_tokens + f.per_log2_batch_s * small_batch

    def prefill_time(self, chunks: list[Chunk]) -> float:
        """Seconds for one prefill pass over `chunks` (whole prompts or one long prompt's chunk)."""
        return (self.prefill.intercept_s + self._prefill_work(chunks)) / self.prefill_speedup + self.served(len(chunks))

    def decode_time(self, batch: int, context_tokens: int) -> float:
        """Seconds for one decode step of `batch` sequences attending to `context_tokens` in all."""
        return (self.decode.intercept_s + self._decode_work(batch, context_tokens)) / self.decode_speedup \
            + self.served(batch)

    def mixed_time(self, chunks: list[Chunk], batch: int, context_tokens: int) -> float:
        """Seconds for one chunked-prefill step: decode rows for `batch` sequences plus prompt `chunks`.

        One pass reads the weights once, so its fixed cost is counted once (the larger of the two
        intercepts); the prompt tokens are charged as in a prefill pass and the decode rows as in a
        decode step; the served overhead once, for every sequence in the pass.
        """
        if not chunks:
            return self.decode_time(batch, context_tokens)
        if batch == 0:
            return self.prefill_time(chunks)
        return max(self.prefill.intercept_s / self.prefill_speedup, self.decode.intercept_s / self.decode_speedup) \
            + self._prefill_work(chunks) / self.prefill_speedup \
            + self._decode_work(batch, context_tokens) / self.decode_speedup + self.served(batch + len(chunks))
