"""How long a worker's Watch call lives (tandem/wire.py Watch; engine/workers/watchers.py ends it).

Triton keeps every response of a request until the request ends (about a kilobyte each, in the
tritonserver process), so a Watch call that lasted as long as its orchestrator would grow its worker's
server for good. A worker ends a Watch call after this many pushes, the last one marked `renew`, and
the orchestrator watches again at once.
"""

from __future__ import annotations

WATCH_RENEW_AFTER = 200


def watch_pushes(asked: int) -> int:
    """The pushes a Watch call gets before it ends: `asked` (Watch.renew_after) if in 1..WATCH_RENEW_AFTER,
    else the most."""
    return asked if 0 < asked <= WATCH_RENEW_AFTER else WATCH_RENEW_AFTER
