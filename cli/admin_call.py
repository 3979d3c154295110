"""One call to a running `tandem serve`'s operator routes (/admin/*, frontdoor/http_admin.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import click


def admin_call(url: str, route: str, method: str = "GET") -> dict:
    """The JSON answer of `route` on the server at `url`, authorized with the deployment secret when one is
    set (TANDEM_SECRET_FILE or TANDEM_SECRET, never the command line); a ClickException saying what failed."""
    from tandem.secret import SecretError, load_secret

    try:
        secret = load_secret()
    except SecretError as e:
        raise click.ClickException(str(e)) from None
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    data = b"" if method == "POST" else None
    req = urllib.request.Request(f"{url.rstrip('/')}{route}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        raise click.ClickException(f"{e.code}: {e.read().decode(errors='replace')}") from None
    except urllib.error.URLError as e:
        raise click.ClickException(f"cannot reach {url}: {e.reason} (is 'tandem serve' running?)") from None
