"""Where a worker sends a request's tokens: one Triton response sender, or a test's list."""

from __future__ import annotations

from typing import Protocol


class TokenSink(Protocol):
    def send(self, token: int, logprob: float | None, finish_reason: str | None) -> None:
        """One generated token; a finish_reason ends the stream."""

    def finish(self, reason: str) -> None:
        """End the stream without a new token (e.g. 'abort' after a release)."""

    def fail(self, message: str) -> None:
        """End the stream with an error (the request was not completed)."""

    def cancelled(self) -> bool:
        """True once the client has gone away or cancelled; the worker then frees the request."""
