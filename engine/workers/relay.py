"""One answer's replies across the Triton calls that carry them: its Open, then each Continue.

A Relay is the Responder a decode worker's lease sends to (engine/workers/sink.py). After `renew_after`
tokens on one call it sends the next token as that call's final reply, carrying a fresh `renew` ticket
(tandem/call_renewal.py says why), and *parks*: what the lease sends next is held, in order, until
`resume(ticket, sink)` brings the Continue call's sink, to which the held replies go first.

    LIVE ──token number renew_after──▶ PARKED ──resume(ticket)──▶ LIVE (on the new call)
      │                                  └─ grace_s without a Continue: cancelled() turns true
      └─ final reply or failure: done (a final one that comes while parked is held for the Continue)

While parked no Triton call exists that could be cancelled, so an orchestrator that died after the
renewal is noticed by the clock: `cancelled()` is true once the relay was parked for `grace_s`, and the
worker ends the lease (its pages go) as for a caller that went away. Thread-safe: the loop thread sends,
a Triton thread resumes.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import replace

from engine.workers.sink import Responder
from tandem.wire import Token


class Relay:
    def __init__(self, sink: Responder, renew_after: int, grace_s: float, clock):
        """`renew_after`: tokens per call (>= 1); `clock()`: seconds (the worker's monotonic clock)."""
        self.sink, self.renew_after, self.grace_s, self.clock = sink, renew_after, grace_s, clock
        self.ticket = ""  # while parked: what the Continue must show
        self._lock = threading.Lock()
        self._tokens = 0  # tokens sent on the current call
        self._parked_at = 0.0
        self._held: list[tuple[object, bool]] = []  # (a reply body or an error, final) while parked
        self._done = False

    @property
    def parked(self) -> bool:
        return bool(self.ticket)

    @property
    def done(self) -> bool:
        """True once the final reply (or a failure) was sent or held."""
        return self._done

    def send(self, body, final: bool = False) -> None:
        with self._lock:
            if self._done:
                return
            if not self.ticket and not final and isinstance(body, Token) and self._tokens + 1 >= self.renew_after:
                self.ticket, self._parked_at, self._tokens = secrets.token_hex(8), self.clock(), 0
                self.sink.send(replace(body, renew=self.ticket), final=True)
                return
            self._pass(body, final)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if not self._done:
                self._pass(error, True)

    def _pass(self, item, final: bool) -> None:
        """A reply body or an error (final), held while parked, else forwarded. Under the lock."""
        self._done = final
        if self.ticket:
            self._held.append((item, final))
        else:
            self._forward(item, final)

    def _forward(self, item, final: bool) -> None:
        if isinstance(item, BaseException):
            self.sink.fail(item)
        else:
            self._tokens += isinstance(item, Token)
            self.sink.send(item, final)

    def cancelled(self) -> bool:
        with self._lock:
            if self.ticket:
                return self.clock() - self._parked_at > self.grace_s
            return self.sink.cancelled()

    def expired(self) -> bool:
        """Parked for longer than `grace_s`: no Continue is coming (its caller is gone)."""
        return self.parked and self.cancelled()

    def resume(self, ticket: str, sink: Responder) -> bool:
        """Go on over `sink` (the Continue call's) if `ticket` is this parked relay's: the held replies
        first, in order. False (nothing sent) for another ticket, or when not parked."""
        with self._lock:
            if not self.ticket or not secrets.compare_digest(self.ticket, ticket):
                return False
            self.sink, self.ticket, held, self._held = sink, "", self._held, []
            for item, final in held:
                self._forward(item, final)
            return True
