"""How long a worker's long-lived calls live: Watch calls, and the calls that carry an answer.

Triton 2.51 (the server in the nvidia-pytriton wheel, which the CPU path runs) keeps every response of a
request until the request ends, about a kilobyte or more each in the tritonserver process, so one call
that lasted as long as its caller would grow the worker's server with every reply it sent. A worker
therefore ends such a call after a bounded number of replies, the last one marked `renew`, and the
caller calls again at once:
- a Watch call ends after `watch_pushes` pushes (WorkerStats.renew); the orchestrator watches again;
- an answer's call (its Open, then each Continue) ends after `answer_tokens` tokens: that call's last
  Token carries a `renew` ticket, and the orchestrator asks for the rest with Continue(request_id,
  ticket). The decode worker holds what it generates meanwhile (engine/workers/relay.py).
Triton 2.56 and later reuse a response once written; renewing there costs one round trip per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

WATCH_RENEW_AFTER = 200  # pushes per Watch call, at most
ANSWER_RENEW_AFTER = 256  # tokens per call of one answer, at most (~1.4 KB each in Triton 2.51's server)


@dataclass(frozen=True)
class Continue:
    """The rest of an answer whose call ended with a Token carrying `renew` -> Token... (decode workers)."""

    TYPE: ClassVar[str] = "continue"
    request_id: str
    ticket: str  # that Token's `renew`: only the caller that read it can go on with the answer


def watch_pushes(asked: int) -> int:
    """The pushes a Watch call gets before it ends: `asked` (Watch.renew_after) if in 1..WATCH_RENEW_AFTER,
    else the most."""
    return _bounded(asked, WATCH_RENEW_AFTER)


def answer_tokens(asked: int) -> int:
    """The tokens one call of an answer carries before it ends: `asked` (Open.renew_after) if in
    1..ANSWER_RENEW_AFTER, else the most."""
    return _bounded(asked, ANSWER_RENEW_AFTER)


def _bounded(asked: int, most: int) -> int:
    return asked if 0 < asked <= most else most
