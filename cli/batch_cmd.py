"""`tandem batch`: answer an OpenAI batch file (JSONL) with a tandem serve, one result line per request.

    tandem batch -i requests.jsonl -o results.jsonl                       # starts a serve (default model), stops it
    tandem batch -i requests.jsonl -o results.jsonl --serve "--prefill 2 --decode 2"
    tandem batch -i requests.jsonl -o results.jsonl --url http://127.0.0.1:8000   # a running serve
    tandem batch -i requests.jsonl -o results.jsonl --resume              # after an interrupted or busy run

Exit status: 0 when every request has its final result (an answer or a refusal such as a 400), 1 when
some are still to ask again (the server stayed busy, or did not answer: rerun with --resume), 2 when
the input file or the options are wrong (nothing is sent).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import ssl
import sys
import tempfile

import click


@click.command("batch")
@click.option("-i", "--input", "input_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="OpenAI batch file: one {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"} a line.")
@click.option("-o", "--output", "output_path", required=True, help="Results, one JSON line per request.")
@click.option("--url", default=None, help="HTTP front door of a running tandem serve (default: start one).")
@click.option("--serve", "serve_args", default="", show_default=False,
              help="Arguments of the tandem serve started when no --url is given (default: the default model, "
                   "1 prefill + 1 decode worker); it is stopped after the batch.")
@click.option("--concurrency", type=click.IntRange(1, 4096), default=8, show_default=True,
              help="Requests in flight at once (keep it within the serve's limits.max_in_flight).")
@click.option("--retries", type=click.IntRange(0, 100), default=8, show_default=True,
              help="How many times a request refused as busy (429, 503) or unanswered is asked again.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1.0), default=600.0, show_default=True,
              help="Seconds one attempt at one request may take.")
@click.option("--resume", is_flag=True, help="Keep the output's final results and ask only for the rest.")
@click.option("--cacert", default=None, type=click.Path(exists=True, dir_okay=False),
              help="PEM CA of the serve's TLS certificate (an https --url).")
def batch_command(input_path, output_path, url, serve_args, concurrency, retries, timeout_s, resume, cacert):
    """Answer an OpenAI batch file with a tandem serve. A server needing an API key gets TANDEM_API_KEY's."""
    from clients.batch.batch_file import BatchFileError, keep_final, read_requests

    try:
        requests = read_requests(input_path)
    except BatchFileError as e:
        click.echo(str(e), err=True)
        sys.exit(2)
    if os.path.exists(output_path) and not resume:
        raise click.UsageError(f"{output_path} exists: --resume continues it, or remove it")
    done = keep_final(output_path) if resume else set()
    todo = [r for r in requests if r.custom_id not in done]
    if done:
        click.echo(f"--resume: {len(requests) - len(todo)} results kept, {len(todo)} requests to ask", err=True)
    if not todo:
        click.echo(f"every request of {input_path} has its result in {output_path}")
        return
    if url is not None:
        tally = _run(todo, url, output_path, concurrency, retries, timeout_s, cacert)
    else:
        tally = _with_serve(shlex.split(serve_args), todo, output_path, concurrency, retries, timeout_s)
    click.echo(tally.summary())
    if tally.not_final:
        click.echo(f"{tally.not_final} requests are still to ask (busy or unanswered): run again with --resume",
                   err=True)
        sys.exit(1)


def _run(todo, url, output_path, concurrency, retries, timeout_s, cacert):
    from clients.batch.batch_run import run_batch

    context = ssl.create_default_context(cafile=cacert) if cacert else None
    key = (os.environ.get("TANDEM_API_KEY") or "").strip() or None
    return asyncio.run(run_batch(todo, len(todo), url, output_path, concurrency=concurrency, retries=retries,
                                 timeout_s=timeout_s, api_key=key, ssl_context=context,
                                 log=lambda m: click.echo(m, err=True)))


def _with_serve(args, todo, output_path, concurrency, retries, timeout_s):
    """Start `tandem serve ARGS` on free loopback ports, run the batch against it, stop it."""
    from ops.serve_process import ServeError, ServeProcess

    workdir = tempfile.mkdtemp(prefix="tandem-batch-")
    click.echo(f"starting tandem serve {' '.join(args)} (logs: {workdir}/serve.log)", err=True)
    try:
        serve = ServeProcess(workdir, tuple(args)).start()
    except ServeError as e:
        raise click.ClickException(str(e)) from None
    try:
        return _run(todo, serve.http, output_path, concurrency, retries, timeout_s, None)
    finally:
        code = serve.stop()
        if code != 0:
            click.echo(f"tandem serve exited with {code}; see {workdir}/serve.log", err=True)
