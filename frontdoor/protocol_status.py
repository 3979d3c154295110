"""A status's code in each front door's protocol: the one table is tandem.status.STATUS_TABLE."""

from __future__ import annotations

import grpc

from tandem.status import STATUS_TABLE, Status, TandemError, status_of

RETRY_AFTER_S = 1  # what a retryable refusal tells the client to wait (HTTP Retry-After)


def grpc_code(status: Status) -> grpc.StatusCode:
    return grpc.StatusCode[STATUS_TABLE[status].grpc_code]


def http_status(status: Status) -> int:
    return STATUS_TABLE[status].http


def http_headers(status: Status) -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)} if STATUS_TABLE[status].retryable else {}


def describe(e: TandemError) -> str:
    """The client-facing text of an error on a gRPC stream: its gRPC code's name and message (as
    Triton's own streams say it; Tandem's finer status, e.g. OUT_OF_PAGES, shows only in HTTP bodies)."""
    return f"{STATUS_TABLE[status_of(e)].grpc_code}: {e}"
