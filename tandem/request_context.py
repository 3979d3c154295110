"""The request a piece of code is working for: its id and what it used, held in a context variable.

A front door sets it when a request arrives (frontdoor/request_ids.py); asyncio copies the context
into every task started while serving that request, so code deep in the orchestrator reads it without
being handed it, and every log line written meanwhile names the request (tandem/logs.py). The record is
shared, not copied: counts the orchestrator adds reach the front door's access log.
"""

from __future__ import annotations

import contextvars
import re
import uuid
from dataclasses import dataclass

MAX_ID_CHARS = 128
_ID = re.compile(r"[A-Za-z0-9._:/@+=-]{1,%d}" % MAX_ID_CHARS)


@dataclass
class RequestRecord:
    request_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    traceparent: str = ""  # the client's W3C `traceparent` (HTTP header or gRPC metadata), if it sent one
    api_key: str = ""  # the name of the API key it presented (frontdoor/api_keys.py), "" without keys
    cache_scope: str = ""  # whose cached prefixes it may share: its key's scope under per-key isolation, else ""


_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("tandem_request", default=None)


def is_valid_id(value: str) -> bool:
    """An id a client may choose: 1-128 characters of letters, digits and . _ : / @ + = - (no spaces, no
    control characters: it is written into logs and headers as it is)."""
    return bool(_ID.fullmatch(value))


def new_request_id() -> str:
    return uuid.uuid4().hex


def begin(request_id: str, traceparent: str = "") -> tuple[RequestRecord, contextvars.Token]:
    """Make `request_id` the current request; `end(token)` restores what was current before."""
    record = RequestRecord(request_id, traceparent=traceparent)
    return record, _current.set(record)


def end(token: contextvars.Token) -> None:
    _current.reset(token)


def current() -> RequestRecord | None:
    return _current.get()


def current_id(default: str = "") -> str:
    record = _current.get()
    return record.request_id if record is not None else default


def client_traceparent() -> str:
    """The current request's W3C traceparent as its client sent it ("" when none, or outside a request)."""
    record = _current.get()
    return record.traceparent if record is not None else ""


def set_caller(api_key: str, cache_scope: str) -> None:
    """The current request came with the API key named `api_key`, and shares cached prefixes only within
    `cache_scope` (frontdoor/auth.py sets both). Raises RuntimeError outside a request: an isolation
    that silently did nothing would be worse."""
    record = _current.get()
    if record is None:
        raise RuntimeError("a caller needs a current request (frontdoor/request_ids.py begins it first)")
    record.api_key, record.cache_scope = api_key, cache_scope


def api_key_name() -> str:
    """The name of the current request's API key ("" when none, or outside a request)."""
    record = _current.get()
    return record.api_key if record is not None else ""


def cache_scope() -> str:
    """The current request's cache scope ("" when none, or outside a request)."""
    record = _current.get()
    return record.cache_scope if record is not None else ""


def note_tokens(prompt: int, completion: int) -> None:
    """Add one answer's token counts to the current request (a batch of prompts adds several)."""
    record = _current.get()
    if record is not None:
        record.prompt_tokens += prompt
        record.completion_tokens += completion
