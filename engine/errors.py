"""Typed errors the engine raises. Each message says what was wrong and what is allowed."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for errors the engine reports to its caller."""


class InvalidRequest(EngineError, ValueError):
    """The request itself is bad (empty prompt, parameter out of range, ...). Nothing was changed."""


class OutOfPages(EngineError):
    """The KV pool has too few free pages for the request. The pool is left exactly as it was."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"KV pool has {free} free pages but the request needs {needed}; "
                         f"retry later or raise the pool size (--kv-pages)")
        self.needed = needed
        self.free = free


class ModelLoadError(EngineError):
    """A checkpoint could not be found, read or understood."""
