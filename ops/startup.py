"""Start-up failures as one line: what did not come up, and the cause its own log gives.

A worker's Triton that will not start leaves a long log; the person starting Tandem needs its cause
(the failing model and why, the port it could not bind) and where the rest is, not a traceback.
"""

from __future__ import annotations

import re

_CAUSE = re.compile(r"error|fail|unavailable|in use|cannot|denied|invalid", re.IGNORECASE)


class StartupError(RuntimeError):
    """Something the start needs did not come up; the first line of the message says what."""


def one_line(e: BaseException) -> str:
    """The first line of `e`, and the last line below it that names a cause (its log tail's)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    head = lines[0].rstrip(":")
    causes = [ln for ln in lines[1:] if _CAUSE.search(ln)]
    return f"{head}: {causes[-1]}" if causes else head
