"""Strict parsing of dataclasses from dicts: unknown keys are an error that lists the allowed ones."""

from __future__ import annotations

from dataclasses import fields


def check_keys(cls, data: dict, what: str, error=ValueError) -> None:
    """Raise `error` if `data` has keys that are not fields of dataclass `cls`."""
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise error(f"unknown {what} {sorted(unknown)}; allowed: {sorted(known)}")
