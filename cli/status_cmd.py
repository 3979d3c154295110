"""`tandem status`: the workers a running `tandem serve` routes to, as it sees them (GET /admin/workers)."""

from __future__ import annotations

import json

import click

from cli.admin_call import admin_call

COLUMNS = ("WORKER", "ROLE", "STATE", "RUNNING", "QUEUED", "PAGES USED/TOTAL", "ADDRESS")


@click.command("status")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="A `tandem serve` HTTP address.")
@click.option("--json", "as_json", is_flag=True, help="Print the server's answer as it came (JSON).")
def status_command(url: str, as_json: bool) -> None:
    """Each worker: its role, whether it is routed to (and why not), its load and address. The deployment
    secret, if any, is read from TANDEM_SECRET_FILE or TANDEM_SECRET, never from the command line."""
    body = admin_call(url, "/admin/workers")
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    click.echo(f"{body['mode']}: {'ready' if body['ready'] else 'NOT READY: ' + ' | '.join(body['not_ready'])}")
    rows = [COLUMNS] + [_row(w) for w in body["workers"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    for r in rows:
        click.echo("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip())
    for w in body["workers"]:
        if w["why_not"]:
            click.echo(f"{w['name']}: {w['why_not']}")


def _row(w: dict) -> tuple[str, ...]:
    """One table row: the worker's own report for load (running, queued prompt tokens, pages), '-' before it."""
    r = w["reported"] or {}
    pages = f"{r['pages_used']}/{r['pages_total']}" if r.get("pages_total") else "-"
    return (w["name"], w["role"], w["state"], str(r.get("running", "-")), str(r.get("queued_tokens", "-")), pages,
            w["url"])
