"""`tandem cache flush`: make every worker behind a running `tandem serve` drop its idle prefix-cache pages."""

from __future__ import annotations

import click

from cli.admin_call import admin_call


@click.group("cache")
def cache_group() -> None:
    """The prefix cache of a running deployment."""


@cache_group.command("flush")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="A `tandem serve` HTTP address.")
def flush_command(url: str) -> None:
    """Drop every worker's idle cached pages (requests in flight keep theirs). The deployment secret, if
    any, is read from TANDEM_SECRET_FILE or TANDEM_SECRET, never from the command line."""
    body = admin_call(url, "/admin/flush", method="POST")
    click.echo(f"flushed {len(body['flushed'])} worker(s): {', '.join(body['flushed']) or '-'}")
