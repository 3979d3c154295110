"""Admission control: bounded work in flight, refused at once beyond it (HTTP 429 / RESOURCE_EXHAUSTED).

Two limits, both deployment keys: requests in flight (being tokenized, or admitted and not finished), and prompt tokens
queued ahead of a request (admitted requests that have not had their first token yet: the prefill
backlog it would wait behind). A request over either is refused before any worker sees it, so an
overload burst costs the accepted requests nothing and memory stays bounded. A third, optional, is per
caller: the requests one API key holder may have in flight (`limits.max_in_flight_per_key`), so one
tenant's burst leaves the others room.

With priorities (`scheduling_policy: priority`) the backlog ahead of a request is the queued prompts of
its priority or a more urgent one: the workers take those first, so a backlog of less urgent work never
turns an urgent request away. The requests in flight stay one limit for all (what bounds memory).
First come, first served every priority is 0 and every queued token is ahead.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

from tandem.status import InvalidArgument, ResourceExhausted


@dataclass
class Admission:
    max_in_flight: int = 64
    max_queued_tokens: int = 32768
    in_flight: int = 0
    queued_tokens: int = 0  # all of them
    queued: Counter = field(default_factory=Counter)  # priority -> its prompt tokens queued
    preparing: int = 0  # passed `check`, being tokenized, not yet admitted (or refused)
    max_in_flight_per_key: int | None = None  # admitted requests of one API key holder; None: no limit of its own
    by_caller: Counter = field(default_factory=Counter)  # caller (the key's name) -> its admitted requests

    def check_size(self, answers: int, caller: str = "") -> None:
        """Refuse, as a client error, a request of more answers than may ever be in flight at once (for
        `caller`, the name of its API key, if any): waiting and retrying could never admit it."""
        if answers > self.max_in_flight:
            raise InvalidArgument(f"the request asks for {answers} answers at once; this server admits at most "
                                  f"{self.max_in_flight} requests at a time (limits.max_in_flight)")
        if caller and self.max_in_flight_per_key and answers > self.max_in_flight_per_key:
            raise InvalidArgument(f"the request asks for {answers} answers at once; this server admits at most "
                                  f"{self.max_in_flight_per_key} requests of one API key holder at a time "
                                  f"(limits.max_in_flight_per_key)")

    def check(self, ahead: int = 0) -> None:
        """Refuse at once, before any work (tokenizing) is spent on a request that cannot be admitted.

        Requests still being prepared count, and `ahead` more on their way in that have not reached
        `prepare` yet: in a burst, the ones that arrive while the first are tokenized are refused at
        the door, not after they too have waited for the tokenizer."""
        busy = self.in_flight + self.preparing + ahead
        if busy >= self.max_in_flight:
            raise ResourceExhausted(f"{busy} requests in flight (limit {self.max_in_flight}); retry after a moment")

    @contextlib.contextmanager
    def prepare(self):
        """Hold a place for a request while it is tokenized; right after, `admit` takes it (or refuses)."""
        self.check()
        self.preparing += 1
        try:
            yield
        finally:
            self.preparing -= 1

    def admit(self, prompt_tokens: int, caller: str = "", priority: int = 0) -> "Ticket":
        """Admit a prepared request of `caller` (the name of its API key; "" without keys) and `priority`
        (lower first), or refuse it. A request alone in the backlog ahead of it is admitted whatever its size."""
        self.check()
        ahead = sum(tokens for p, tokens in self.queued.items() if p <= priority)
        if ahead and ahead + prompt_tokens > self.max_queued_tokens:
            of = f" of priority {priority} or more urgent" if ahead < self.queued_tokens else ""
            raise ResourceExhausted(f"{ahead} prompt tokens{of} are queued (limit {self.max_queued_tokens}); "
                                    f"retry after a moment")
        mine = self.by_caller[caller] if caller else 0
        if caller and self.max_in_flight_per_key and mine >= self.max_in_flight_per_key:
            raise ResourceExhausted(f"API key holder {caller!r} has {mine} requests in flight, the most one holder "
                                    f"may have (limits.max_in_flight_per_key); retry after a moment")
        self.in_flight += 1
        self.queued_tokens += prompt_tokens
        self.queued[priority] += prompt_tokens
        if caller:
            self.by_caller[caller] += 1
        return Ticket(self, prompt_tokens, caller, priority)


class Ticket:
    """One admitted request: `first_token()` when its prompt is done, `close()` when it ends."""

    def __init__(self, admission: Admission, tokens: int, caller: str = "", priority: int = 0):
        self.admission, self.tokens, self.caller, self.priority, self.open = admission, tokens, caller, priority, True

    def first_token(self) -> None:
        a = self.admission
        a.queued_tokens -= self.tokens
        a.queued[self.priority] -= self.tokens
        if not a.queued[self.priority]:
            del a.queued[self.priority]
        self.tokens = 0

    def close(self) -> None:
        if self.open:
            self.open = False
            self.first_token()
            self.admission.in_flight -= 1
            if self.caller:
                held = self.admission.by_caller
                held[self.caller] -= 1
                if not held[self.caller]:
                    del held[self.caller]
