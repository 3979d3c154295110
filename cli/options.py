"""Option callbacks more than one command line uses."""

from __future__ import annotations

import click


def name_path_pairs(ctx, param, values: tuple[str, ...]) -> dict[str, str] | None:
    """A repeated NAME=PATH option (e.g. --lora-modules) as a mapping; None when none is given."""
    bad = [v for v in values if "=" not in v or v.startswith("=")]
    if bad:
        raise click.BadParameter(f"{bad[0]!r}: NAME=PATH is needed, e.g. sql=/adapters/sql-lora")
    return dict(v.split("=", 1) for v in values) or None
