"""Typed errors the engine raises. Each message says what was wrong and what is allowed.

They are the statuses of tandem/status.py, so a worker's reply carries the right status from the
exception's type alone: a bad request is INVALID_ARGUMENT, a full pool OUT_OF_PAGES.
"""

from __future__ import annotations

from tandem import status


class EngineError(status.TandemError):
    """Base class for errors the engine reports to its caller (INTERNAL unless a subclass says more)."""


class InvalidRequest(EngineError, status.InvalidArgument):
    """The request itself is bad (empty prompt, parameter out of range, ...). Nothing was changed."""


class OutOfPages(EngineError, status.OutOfPages):
    """The KV pool has too few free pages for the request. The pool is left exactly as it was."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"KV pool has {free} free pages but the request needs {needed}; "
                         f"retry later or raise the pool size (kv_pool_bytes)")
        self.needed = needed
        self.free = free


class ModelLoadError(EngineError):
    """A checkpoint could not be found, read or understood."""
