"""The running decode batch of one engine: every sequence in it gets one token per decode step.

Bookkeeping is O(1) per step: the batch keeps the total context (what a step attends to) and, per
future step index, the sequences whose last token that step produces.
"""

from __future__ import annotations

from planner.sim.request import SimRequest


class RunningBatch:
    def __init__(self) -> None:
        self.size = 0
        self.context_tokens = 0  # summed over the batch: each sequence's prompt + tokens so far
        self.step_ends: list[float] = []  # end time of every decode step this engine ran
        self._finish: dict[int, list[SimRequest]] = {}

    def join(self, req: SimRequest) -> None:
        """Add a request that has its first token (output_len >= 2); it decodes from the next step."""
        if req.output_len < 2:
            raise ValueError("a request with a single output token is done after prefill")
        k = len(self.step_ends)
        req.steps, req.step0 = self.step_ends, k
        self._finish.setdefault(k + req.output_len - 2, []).append(req)
        self.size += 1
        self.context_tokens += req.prompt_len + 1

    def leave(self, req: SimRequest) -> None:
        """Take a running request out before its end (preempted)."""
        self._finish[req.step0 + req.output_len - 2].remove(req)
        self.size -= 1
        self.context_tokens -= req.prompt_len + 1 + (len(self.step_ends) - req.step0)

    def step_done(self, now: float) -> list[SimRequest]:
        """Record a decode step that ended at `now`; return (and drop) the requests it finished."""
        self.step_ends.append(now)
        self.context_tokens += self.size
        done = self._finish.pop(len(self.step_ends) - 1, [])
        for req in done:
            self.size -= 1
            self.context_tokens -= req.prompt_len + req.output_len
        return done
