"""How a deployment serves (Mode) and how K/V moves from a prefill worker to a decode worker (HandoffMode).

Text enums (tandem/roles.py TextEnum): the deployment file, CLI choices and JSON keep the same words.
"""

from __future__ import annotations

from tandem.roles import Role, TextEnum


class Mode(TextEnum):
    """The serving path: separate prefill and decode workers, or one of the two co-located baselines."""

    DISAGGREGATED = "disaggregated"  # prefill workers hand K/V to decode workers
    COLOCATED = "colocated"  # each `generate` worker prefills and decodes its own requests
    CHUNKED = "chunked"  # co-located, prompts mixed into decode steps in chunks

    @property
    def roles(self) -> tuple[Role, ...]:
        """The worker roles this mode routes to."""
        return (Role.PREFILL, Role.DECODE) if self is Mode.DISAGGREGATED else (Role.GENERATE,)


class HandoffMode(TextEnum):
    """Who moves the K/V (control/handoff.py): push, prefill writes into pages decode reserved; pull,
    prefill holds them in its own pool and decode reads them."""

    PUSH = "push"
    PULL = "pull"
