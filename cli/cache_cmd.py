"""`tandem cache flush`: make every worker behind a running `tandem serve` drop its idle prefix-cache pages."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import click


@click.group("cache")
def cache_group() -> None:
    """The prefix cache of a running deployment."""


@cache_group.command("flush")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="A `tandem serve` HTTP address.")
def flush_command(url: str) -> None:
    """Drop every worker's idle cached pages (requests in flight keep theirs). The deployment secret, if
    any, is read from TANDEM_SECRET_FILE or TANDEM_SECRET, never from the command line."""
    from tandem.secret import SecretError, load_secret

    try:
        secret = load_secret()
    except SecretError as e:
        raise click.ClickException(str(e)) from None
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    req = urllib.request.Request(f"{url.rstrip('/')}/admin/flush", data=b"", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            body = json.load(resp)
    except urllib.error.HTTPError as e:
        raise click.ClickException(f"{e.code}: {e.read().decode(errors='replace')}") from None
    except urllib.error.URLError as e:
        raise click.ClickException(f"cannot reach {url}: {e.reason} (is 'tandem serve' running?)") from None
    click.echo(f"flushed {len(body['flushed'])} worker(s): {', '.join(body['flushed']) or '-'}")
