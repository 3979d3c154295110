"""Typed statuses: every reply that crosses a process boundary carries one, set from the exception type.

A worker raises one of the `TandemError` classes below (or anything else, which becomes INTERNAL);
the reply carries `status_of(exc)`; the receiving side turns it back into the same class with
`error_for(status, message)`. The front doors map a status to a gRPC code and an HTTP status through
`STATUS_TABLE`, the one place where that mapping lives:

    status              gRPC code            HTTP  retryable  whose fault
    OK                  OK                   200   -          -
    INVALID_ARGUMENT    INVALID_ARGUMENT     400   no         client
    NOT_FOUND           NOT_FOUND            404   no         client
    METHOD_NOT_ALLOWED  UNIMPLEMENTED        405   no         client (HTTP: a route without that method)
    TOO_LARGE           RESOURCE_EXHAUSTED   413   no         client (a body over the size limit)
    REQUEST_TIMEOUT     DEADLINE_EXCEEDED    408   no         client (HTTP: its request did not arrive whole
                                                                 in time, frontdoor/http_gate.py)
    UNAUTHENTICATED     UNAUTHENTICATED      401   no         client
    OUT_OF_PAGES        RESOURCE_EXHAUSTED   429   yes        capacity (KV pool full past the deadline)
    RESOURCE_EXHAUSTED  RESOURCE_EXHAUSTED   429   yes        capacity (admission limits)
    LEASE_LOST          UNAVAILABLE          503   yes        server (a party to the request died)
    TRANSFER_FAILED     UNAVAILABLE          503   yes        server (the KV handoff failed)
    UNAVAILABLE         UNAVAILABLE          503   yes        server (no healthy worker)
    CANCELLED           CANCELLED            499   no         client (went away or cancelled)
    DEADLINE_EXCEEDED   DEADLINE_EXCEEDED    504   yes        server (the request's deadline passed)
    PROTOCOL_ERROR      INTERNAL             500   no         server (a worker refused a control message
                                                                 the orchestrator built: a bug or mixed builds)
    INTERNAL            INTERNAL             500   no         server (a bug: see the log)

A server-side fault is never reported as a client error: only the "client" rows are 4xx
(429 means "too busy now, retry after Retry-After", not "you did something wrong"). A worker tells
apart a request it cannot serve (INVALID_ARGUMENT: the prompt or a parameter, the client's) from a
control message that breaks the protocol (PROTOCOL_ERROR: an id, a lease, a step out of order, a
malformed or foreign-build message; the orchestrator built it from a request already validated, so to
the client it is the server's fault).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(str, enum.Enum):
    OK = "OK"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    TOO_LARGE = "TOO_LARGE"
    REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    OUT_OF_PAGES = "OUT_OF_PAGES"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    LEASE_LOST = "LEASE_LOST"
    TRANSFER_FAILED = "TRANSFER_FAILED"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    PROTOCOL_ERROR = "PROTOCOL_ERROR"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class StatusInfo:
    grpc_code: str  # the name of a grpc.StatusCode member (kept as text: this module imports no grpc)
    http: int
    retryable: bool  # a client may send the same request again (after Retry-After)


STATUS_TABLE: dict[Status, StatusInfo] = {
    Status.OK: StatusInfo("OK", 200, False),
    Status.INVALID_ARGUMENT: StatusInfo("INVALID_ARGUMENT", 400, False),
    Status.NOT_FOUND: StatusInfo("NOT_FOUND", 404, False),
    Status.METHOD_NOT_ALLOWED: StatusInfo("UNIMPLEMENTED", 405, False),
    Status.TOO_LARGE: StatusInfo("RESOURCE_EXHAUSTED", 413, False),
    Status.REQUEST_TIMEOUT: StatusInfo("DEADLINE_EXCEEDED", 408, False),
    Status.UNAUTHENTICATED: StatusInfo("UNAUTHENTICATED", 401, False),
    Status.OUT_OF_PAGES: StatusInfo("RESOURCE_EXHAUSTED", 429, True),
    Status.RESOURCE_EXHAUSTED: StatusInfo("RESOURCE_EXHAUSTED", 429, True),
    Status.LEASE_LOST: StatusInfo("UNAVAILABLE", 503, True),
    Status.TRANSFER_FAILED: StatusInfo("UNAVAILABLE", 503, True),
    Status.UNAVAILABLE: StatusInfo("UNAVAILABLE", 503, True),
    Status.CANCELLED: StatusInfo("CANCELLED", 499, False),
    Status.DEADLINE_EXCEEDED: StatusInfo("DEADLINE_EXCEEDED", 504, True),
    Status.PROTOCOL_ERROR: StatusInfo("INTERNAL", 500, False),
    Status.INTERNAL: StatusInfo("INTERNAL", 500, False),
}


class TandemError(Exception):
    """Base of every error that crosses a process boundary; `status` says what kind it is."""

    status = Status.INTERNAL

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param  # the offending request field, when there is one (OpenAI error bodies name it)


class InvalidArgument(TandemError):
    """The request itself is bad (empty prompt, parameter out of range, ...). Nothing was changed."""

    status = Status.INVALID_ARGUMENT


class NotFound(TandemError):
    status = Status.NOT_FOUND


class MethodNotAllowed(TandemError):
    status = Status.METHOD_NOT_ALLOWED


class TooLarge(TandemError):
    """The request is over a size limit (its body, say); the message says the limit."""

    status = Status.TOO_LARGE


class RequestTimeout(TandemError):
    """The client did not send its whole request (head and body) in the time the front door gives it."""

    status = Status.REQUEST_TIMEOUT


class Unauthenticated(TandemError):
    """The caller did not present the deployment's secret."""

    status = Status.UNAUTHENTICATED


class OutOfPages(TandemError):
    """A KV pool has too few free pages for the request right now. The pool is unchanged."""

    status = Status.OUT_OF_PAGES


class ResourceExhausted(TandemError):
    """Admission control refused the request (too many in flight or too many prompt tokens queued)."""

    status = Status.RESOURCE_EXHAUSTED


class LeaseLost(TandemError):
    """The pages a request held are gone (released, fenced, or their owner died)."""

    status = Status.LEASE_LOST


class TransferFailed(TandemError):
    """The KV handoff could not be done or did not complete."""

    status = Status.TRANSFER_FAILED


class Unavailable(TandemError):
    """No worker could serve the request now (unreachable, stalled, or none healthy)."""

    status = Status.UNAVAILABLE


class Cancelled(TandemError):
    status = Status.CANCELLED


class DeadlineExceeded(TandemError):
    status = Status.DEADLINE_EXCEEDED


class ProtocolError(TandemError):
    """A control message breaks the protocol: malformed, from another build, naming a lease or hold that
    is not the request's, or a step out of order. The worker changed nothing."""

    status = Status.PROTOCOL_ERROR


class Internal(TandemError):
    status = Status.INTERNAL


_CLASSES: dict[Status, type[TandemError]] = {
    c.status: c for c in (InvalidArgument, NotFound, MethodNotAllowed, TooLarge, RequestTimeout, Unauthenticated,
                          OutOfPages, ResourceExhausted, LeaseLost, TransferFailed, Unavailable, Cancelled,
                          DeadlineExceeded, ProtocolError, Internal)
}


def status_of(exc: BaseException) -> Status:
    """The status a reply carries for this exception: by its type, INTERNAL for anything not ours."""
    return exc.status if isinstance(exc, TandemError) else Status.INTERNAL


def error_for(status: Status, message: str) -> TandemError:
    """The exception a receiver raises for a non-OK status (the inverse of status_of)."""
    if status is Status.OK:
        raise ValueError("OK is not an error status")
    return _CLASSES[status](message)


def retryable(status: Status) -> bool:
    return STATUS_TABLE[status].retryable
