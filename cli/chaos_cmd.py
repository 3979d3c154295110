"""`tandem chaos`: run the fault-injection harness against a running `tandem serve`, or one it starts.

    tandem chaos --serve "--prefill 2 --decode 2" --out docs/chaos/2p2d      # start one, hurt it, stop it
    tandem chaos --url http://127.0.0.1:8000 --workdir /tmp/tandem-serve-x  # an existing one
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import tempfile

import click

DEFAULT = "kill-prefill-0,kill-decode-0,stop-prefill-0,stop-decode-0,cancel-storm,overload,backlog"


@click.command("chaos")
@click.option("--url", default=None, help="HTTP front door of a running tandem serve.")
@click.option("--workdir", default=None, help="Its --workdir (workers.json says which pid is which worker).")
@click.option("--serve", "serve_args", default=None, help="Start a tandem serve with these arguments instead.")
@click.option("--engines", default=None, help="Engines folder: references come from an in-process engine.")
@click.option("--scenarios", default=DEFAULT, show_default=True)
@click.option("--quick", is_flag=True, help="Seconds per fault instead of minutes (CI).")
@click.option("--capacity", type=click.IntRange(1), default=32, show_default=True,
              help="The deployment's limits.max_in_flight (the overload burst is a multiple of it).")
@click.option("--out", default=None, help="Write report.json and report.md here.")
def chaos_command(url, workdir, serve_args, engines, scenarios, quick, capacity, out):
    """Inject faults one after another under load and report what the service did."""
    from clients.chaos import scenarios as sc
    from clients.chaos.chaos_run import ChaosRun

    if not serve_args and not (url and workdir):
        raise click.UsageError("give --url and --workdir of a running tandem serve, or --serve ARGS")
    try:
        faults = [sc.make(n.strip()) for n in scenarios.split(",") if n.strip()]
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    run = ChaosRun(faults, quick=quick, capacity=capacity, engines=engines, log=lambda m: click.echo(m, err=True))
    if serve_args:
        doc = run.with_serve(shlex.split(serve_args), tempfile.mkdtemp(prefix="tandem-chaos-"))
    else:
        doc = asyncio.run(run.against(url, workdir))
    from clients.chaos.chaos_report import markdown, write

    command = "tandem " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if out:
        write(doc, out, command)
        click.echo(f"report written to {os.path.join(out, 'report.md')}", err=True)
    click.echo(markdown(doc, command))
