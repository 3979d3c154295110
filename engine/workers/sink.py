"""Where a worker sends a request's replies: a Triton response sender (engine/triton/common.py), or a
test's list. One request gets one or more replies; the last one is final."""

from __future__ import annotations

from typing import Protocol


class Responder(Protocol):
    def send(self, body, final: bool = False) -> None:
        """One OK reply (a tandem.wire reply dataclass); `final` ends the request."""

    def fail(self, error: BaseException) -> None:
        """End the request with the status of `error` (tandem.status.status_of) and its message."""

    def cancelled(self) -> bool:
        """True once the caller has gone away or cancelled, or a send failed; the worker then drops it."""

    @property
    def done(self) -> bool:
        """True once a final reply was sent."""
