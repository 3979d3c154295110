"""Admission control: bounded work in flight, refused at once beyond it (HTTP 429 / RESOURCE_EXHAUSTED).

Two limits, both deployment keys: requests in flight (admitted and not finished), and prompt tokens
queued (admitted requests that have not had their first token yet: the prefill backlog). A request
over either is refused before any worker sees it, so an overload burst costs the accepted requests
nothing and memory stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.status import ResourceExhausted


@dataclass
class Admission:
    max_in_flight: int = 64
    max_queued_tokens: int = 32768
    in_flight: int = 0
    queued_tokens: int = 0

    def check(self) -> None:
        """Refuse at once, before any work (tokenizing) is spent on a request that cannot be admitted."""
        if self.in_flight >= self.max_in_flight:
            raise ResourceExhausted(f"{self.in_flight} requests in flight (limit {self.max_in_flight}); "
                                    f"retry after a moment")

    def admit(self, prompt_tokens: int) -> "Ticket":
        self.check()
        if self.queued_tokens and self.queued_tokens + prompt_tokens > self.max_queued_tokens:
            raise ResourceExhausted(f"{self.queued_tokens} prompt tokens are queued (limit {self.max_queued_tokens}); "
                                    f"retry after a moment")
        self.in_flight += 1
        self.queued_tokens += prompt_tokens
        return Ticket(self, prompt_tokens)


class Ticket:
    """One admitted request: `first_token()` when its prompt is done, `close()` when it ends."""

    def __init__(self, admission: Admission, tokens: int):
        self.admission, self.tokens, self.open = admission, tokens, True

    def first_token(self) -> None:
        self.admission.queued_tokens -= self.tokens
        self.tokens = 0

    def close(self) -> None:
        if self.open:
            self.open = False
            self.first_token()
            self.admission.in_flight -= 1
