"""`tandem bench multiturn`: the multi-turn workload (clients/bench/multiturn.py) against a running
front door, per-turn statistics printed and optionally written as JSON."""

from __future__ import annotations

import asyncio
import os

import click


@click.command("multiturn")
@click.option("--url", default="127.0.0.1:8001", show_default=True, help="Front door (gRPC host:port or HTTP URL).")
@click.option("--protocol", type=click.Choice(["grpc", "openai"]), default="grpc", show_default=True)
@click.option("--metrics-url", default=None, help="The front door's HTTP address, for KV bytes and cache hits "
                                                  "per turn (default: --url with --protocol openai).")
@click.option("--conversations", type=click.IntRange(1), default=8, show_default=True)
@click.option("--turns", type=click.IntRange(1), default=6, show_default=True)
@click.option("--system-tokens", type=click.IntRange(1), default=512, show_default=True,
              help="Length of the system prompt every conversation shares.")
@click.option("--user-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--answer-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--slo-ttft-ms", type=float, default=1500, show_default=True)
@click.option("--slo-tpot-ms", type=float, default=150, show_default=True)
@click.option("--tokenizer", default=None, help="Folder with tokenizer.json (default: the default model's).")
@click.option("--out", default=None, help="Write multiturn.json here.")
def multiturn_command(url, protocol, metrics_url, conversations, turns, system_tokens, user_tokens, answer_tokens,
                      seed, slo_ttft_ms, slo_tpot_ms, tokenizer, out):
    """Conversations growing turn by turn behind a shared system prompt; each turn's prompt is the whole
    conversation so far. Reports turn 1 and turns >= 2 apart (where a prefix cache pays)."""
    from cli.bench_cmd import _tokenizer
    from clients.bench.multiturn import MultiTurn, make_turns_client, run_multiturn
    from clients.bench.multiturn_report import multiturn_table, summarize_multiturn, turns_json
    from clients.bench.bench_report import write_json

    spec = MultiTurn(conversations, turns, system_tokens, user_tokens, answer_tokens, seed)
    if metrics_url is None and protocol == "openai":
        metrics_url = url if url.startswith("http") else f"http://{url}"

    async def go():
        client = make_turns_client(protocol, url)
        try:
            return await run_multiturn(spec, client, _tokenizer(tokenizer), metrics_url)
        finally:
            await client.close()

    run = asyncio.run(go())
    summary = summarize_multiturn(run, slo_ttft_ms / 1e3, slo_tpot_ms / 1e3)
    for group in summary:
        click.echo(f"{group}:\n" + multiturn_table({protocol: summary}, group) + "\n")
    if out:
        write_json(os.path.join(out, "multiturn.json"), {"workload": spec.to_dict(), "summary": summary,
                                                         "rounds": run["rounds"], "turns": turns_json(run["turns"])})
    failed = summary["all"].get("failed")
    if failed:
        raise click.ClickException(f"{failed} turn(s) failed")
