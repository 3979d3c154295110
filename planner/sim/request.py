"""One simulated request: its shape and the (simulated) times things happened to it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

NAN = math.nan


@dataclass(eq=False)
class SimRequest:
    """Times are engine-side seconds since the start; front-door overhead is added in metrics.py.

    Tokens: the first comes from the prefill pass (at `first_token`), the other output_len - 1 from
    consecutive decode steps of one worker: `steps[step0 : step0 + output_len - 1]` (a running
    sequence gets a token from every decode step, so its token times are a slice of that worker's
    step-end times, and recording them costs nothing per token).
    """

    index: int
    prompt_len: int
    output_len: int
    arrival: float = NAN
    reserved_at: float = NAN  # its KV pages were reserved
    prefill_start: float = NAN  # its first prefill pass began
    first_token: float = NAN
    done_at: float = NAN  # its last token (engine side)
    steps: list[float] | None = None
    step0: int = 0
    pages: int = 0  # pages it holds while reserved
    failed: str | None = None
    priority: int = 0  # lower goes first (the serving code's priority scheduling); all 0: first come, first served

    @property
    def finished(self) -> bool:
        return not math.isnan(self.done_at)

    @property
    def budget(self) -> int:
        """Tokens it may hold in the KV pool: prompt + every output token."""
        return self.prompt_len + self.output_len

    def token_times(self) -> np.ndarray:
        """Engine time of each output token: [output_len]."""
        rest = self.steps[self.step0:self.step0 + self.output_len - 1] if self.output_len > 1 else []
        return np.asarray([self.first_token, *rest], dtype=np.float64)
