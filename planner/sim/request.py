"""One simulated request: its shape and the (simulated) times things happened to it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

NAN = math.nan


@dataclass(eq=False)
class SimRequest:
    """Times are engine-side seconds since the start; front-door overhead is added in metrics.py.

    Tokens: the first comes from the prefill pass (at `first_token`), the other output_len - 1 from
    consecutive decode steps of one worker: `steps[step0 : step0 + output_len - 1]` (a running
    sequence gets a token from every decode step, so its token times are a slice of that worker's
    step-end times, and recording them costs nothing per token).

    Preempted (its pages taken by a more urgent request), it resumes as the serving path does: its
    tokens so far are kept (`prior`), the next attempt prefills them with the prompt (`prompt_len`
    grows by as many, `output_len` shrinks by as many: the same pages) and streams the rest.
    `attempt` counts its preemptions, so work queued for an earlier attempt is known stale.
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
    prior: list[float] = field(default_factory=list)  # times of the tokens of attempts it was preempted from
    attempt: int = 0

    @property
    def finished(self) -> bool:
        return not math.isnan(self.done_at)

    @property
    def budget(self) -> int:
        """Tokens it may hold in the KV pool: prompt + every output token."""
        return self.prompt_len + self.output_len

    @property
    def answer_len(self) -> int:
        """Output tokens of the whole answer, every attempt's."""
        return len(self.prior) + self.output_len

    def preempted(self, produced: list[float]) -> None:
        """Its attempt ended after producing tokens at `produced`; the next one goes on from there."""
        self.prior += produced
        self.prompt_len += len(produced)
        self.output_len -= len(produced)
        self.attempt += 1
        self.first_token = self.done_at = NAN
        self.steps, self.step0 = None, 0

    def token_times(self) -> np.ndarray:
        """Engine time of each output token: [answer_len]."""
        rest = self.steps[self.step0:self.step0 + self.output_len - 1] if self.output_len > 1 else []
        return np.asarray([*self.prior, self.first_token, *rest], dtype=np.float64)

    def attempt_times(self) -> list[float]:
        """Times of the tokens this attempt produced so far (`steps` holds every step ended yet)."""
        if math.isnan(self.first_token):
            return []
        return [self.first_token, *self.steps[self.step0:]] if self.steps is not None else [self.first_token]
