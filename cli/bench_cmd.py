"""`tandem bench` and `tandem bench compare` command lines."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import click

from clients.bench.bench_workload import SCENARIOS, Scenario, Stream


def _tokenizer(path: str | None):
    from engine.checkpoint import resolve
    from engine.tokenizer import Tokenizer

    return Tokenizer(path or resolve("smollm2-135m").folder)


@click.group("bench", invoke_without_command=True)
@click.option("--url", default="127.0.0.1:8001", show_default=True, help="Front door (gRPC host:port or HTTP URL).")
@click.option("--protocol", type=click.Choice(["grpc", "openai"]), default="grpc", show_default=True)
@click.option("--scenario", type=click.Choice(sorted(SCENARIOS)), default=None, help="A built-in workload ...")
@click.option("--dataset", default=None,
              help="... or prompts from this file: ShareGPT JSON (answers as long as its replies, as vLLM's "
                   "benchmark) or JSON Lines of {\"prompt\", \"max_tokens\"}; --requests of them, shuffled by --seed.")
@click.option("--prompt-len", type=click.IntRange(1), default=256, show_default=True, help="... or this one.")
@click.option("--output-len", type=click.IntRange(1), default=64, show_default=True,
              help="Answer tokens (with --dataset: where the file gives none; given, it sets them all).")
@click.option("--output-len-max", type=click.IntRange(0), default=0, help="Draw output lengths up to this.")
@click.option("--requests", type=click.IntRange(1), default=32, show_default=True)
@click.option("--concurrency", type=click.IntRange(0), default=8, show_default=True)
@click.option("--rate", type=float, default=0.0, help="Poisson arrivals (requests/s) instead of a concurrency.")
@click.option("--warmup", type=click.IntRange(0), default=2, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--slo-ttft-ms", type=float, default=1500, show_default=True)
@click.option("--slo-tpot-ms", type=float, default=150, show_default=True)
@click.option("--tokenizer", default=None, help="Folder with tokenizer.json (default: the default model's).")
@click.option("--out", default=None, help="Write report.json, report.md and plots here.")
@click.option("--lora-modules", multiple=True,
              help="LoRA adapters' names (repeated or comma-separated): each request names one, drawn by --seed "
                   "(as vLLM's benchmark); the prompts stay those of the run without.")
@click.pass_context
def bench_group(ctx, url, protocol, scenario, dataset, prompt_len, output_len, output_len_max, requests, concurrency,
                rate, warmup, seed, slo_ttft_ms, slo_tpot_ms, tokenizer, out, lora_modules):
    """Drive a front door with a workload; print TTFT / ITL / E2E percentiles, throughput and goodput."""
    if ctx.invoked_subcommand is not None:
        return
    from clients.bench import bench_plots as plots
    from clients.bench.drivers import make_driver
    from clients.bench.bench_report import records_json, table, write_json
    from clients.bench.runner import run_scenario
    from clients.bench.stats import summarize

    if scenario and dataset:
        raise click.UsageError("give --scenario or --dataset, not both")
    arrivals = {"concurrency": 0 if rate else concurrency, "rate": rate}
    tok = _tokenizer(tokenizer)
    if scenario:
        sc = SCENARIOS[scenario]
    elif dataset:
        given = ctx.get_parameter_source("output_len") != click.core.ParameterSource.DEFAULT
        sc = _dataset(dataset, tok, requests, seed, output_len if given else None, output_len, arrivals, warmup)
    else:
        try:
            stream = Stream("custom", prompt_len, output_len, requests, output_len_max=output_len_max, **arrivals)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        sc = Scenario("custom", (stream,), warmup=warmup, seed=seed)
    models = tuple(m for given in lora_modules for m in given.split(",") if m)
    if models:
        sc = dataclasses.replace(sc, models=models)

    async def go():
        driver = make_driver(protocol, url)
        try:
            return await run_scenario(sc, driver, tok)
        finally:
            await driver.close()

    records = asyncio.run(go())
    summary = summarize(records, slo_ttft_ms / 1e3, slo_tpot_ms / 1e3)
    click.echo(table({sc.name: summary}))
    if out:
        write_json(os.path.join(out, "report.json"), {"scenario": sc.to_dict(), "summary": summary,
                                                      "records": records_json(records)})
        with open(os.path.join(out, "report.md"), "w") as f:
            f.write(table({sc.name: summary}) + "\n")
        plots.cdf({sc.name: records}, "ttft", os.path.join(out, "ttft-cdf.png"), "TTFT CDF")
        plots.cdf({sc.name: records}, "itl", os.path.join(out, "itl-cdf.png"), "Inter-token gap CDF")
        plots.timeline({sc.name: records}, os.path.join(out, "timeline.png"), "Token timeline")
        click.echo(f"report written to {out}")
    if summary.get("failed"):
        raise click.ClickException(f"{summary['failed']} request(s) failed")


def _dataset(path: str, tok, requests: int, seed: int, output_len: int | None, default_output_len: int,
             arrivals: dict, warmup: int) -> Scenario:
    """The scenario of `requests` prompts of the file at `path` (clients/bench/dataset.py)."""
    from clients.bench.dataset import sample

    try:
        got, note = sample(path, tok, requests, seed, output_len, default_output_len)
    except (OSError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--dataset") from None
    try:
        stream = Stream("dataset", _mean([g.prompt_tokens for g in got]), _mean([g.output_tokens for g in got]),
                        len(got), prompts=tuple((g.prompt, g.output_tokens) for g in got), source=path, **arrivals)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if note:
        click.echo(note, err=True)
    return Scenario("dataset", (stream,), warmup=warmup, seed=seed,
                    description=f"{len(got)} prompts of {path} ({stream.prompt_len} prompt / {stream.output_len} "
                                f"answer tokens on average)")


def _mean(xs: list[int]) -> int:
    return max(1, round(sum(xs) / len(xs)))


@bench_group.command("compare")
@click.option("--engines", default="smollm2-135m", show_default=True, help="Model or engines folder to serve.")
@click.option("--suite", type=click.Choice(["equal-hardware", "equal-hardware-quick"]), default=None,
              help="Run a whole suite instead of --scenarios: the seed bursts, a Poisson rate sweep, and the "
                   "planner's predictions side by side (see docs/benchmarks/equal-hardware).")
@click.option("--scenarios", default="steady,stall", show_default=True)
@click.option("--layouts", default=None,
              help="Comma-separated layouts of exactly --cores cores, e.g. '1P1D,colocated 2x1,colocated 1x2' "
                   "(default: every xPyD split, co-located replicas, one co-located worker, and chunked).")
@click.option("--cores", default=None, help="Cores every layout gets, e.g. 0,1 (default: all this process may use).")
@click.option("--protocol", type=click.Choice(["grpc", "openai"]), default="grpc", show_default=True)
@click.option("--out", required=True, help="Report folder (report.json, report.md, plots).")
@click.option("--slo-ttft-ms", type=float, default=1500, show_default=True, help="(--scenarios only)")
@click.option("--slo-tpot-ms", type=float, default=150, show_default=True, help="(--scenarios only)")
@click.option("--kv-pool-bytes", type=click.IntRange(1 << 20), default=2 << 30, show_default=True,
              help="KV pool of every decode or co-located worker.")
@click.option("--chunk-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--profile", "profile_path", default=None,
              help="--suite: the hardware profile to predict with (default: measure one first with tandem profile).")
@click.option("--handoff-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--suite: handoff GB/s for the profile measured first (scripts/bench_handoff.py, shm).")
@click.option("--note", default="", help="--suite: a note on the machine for the report (e.g. 'shared, busy').")
@click.option("--resume", is_flag=True,
              help="--suite: reuse the layouts already run into OUT/runs.json (a stopped run, or a rebuilt report).")
def compare_command(engines, suite, scenarios, layouts, cores, protocol, out, slo_ttft_ms, slo_tpot_ms, kv_pool_bytes,
                    chunk_tokens, profile_path, handoff_gbps, note, resume):
    """Run the same workloads against serving layouts on equal hardware, one after another, into one report."""
    from cli.compare_cmd import run_from_cli

    run_from_cli(engines=engines, suite=suite, scenarios=scenarios, layouts=layouts, cores=cores, protocol=protocol,
                 out=out, slo=(slo_ttft_ms / 1e3, slo_tpot_ms / 1e3), kv_pool_bytes=kv_pool_bytes,
                 chunk_tokens=chunk_tokens, profile=profile_path, handoff_gbps=handoff_gbps, note=note, resume=resume,
                 tokenizer=_tokenizer(None))


from cli.multiturn_cmd import multiturn_command  # noqa: E402  (after the group it joins)

bench_group.add_command(multiturn_command)
