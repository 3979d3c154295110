"""`tandem profile` and `tandem plan`: measure a hardware profile; plan a layout from one."""

from __future__ import annotations

import click

from planner.plan_workload import LENGTH_HELP, PRIORITIES_HELP


def _rates(_ctx, _param, value: str | None) -> tuple[float, ...] | None:
    if value is None:
        return None
    try:
        rates = tuple(float(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give rates in requests/s separated by commas, e.g. 1,2,4") from None
    if not rates or any(r <= 0 for r in rates):
        raise click.BadParameter(f"{value!r}: every rate must be > 0 requests/s")
    return rates


@click.command("plan")
@click.option("--profile", "profile_path", required=True, type=click.Path(dir_okay=False),
              help="Hardware profile JSON (from `tandem profile`, or hand-written: docs/planning/profiles/).")
@click.option("--devices", required=True, type=click.IntRange(1, 1024),
              help="Devices to plan for: GPUs on a cluster, cores for a CPU profile.")
@click.option("--prompt-len", default="512", show_default=True, help=f"Prompt tokens: {LENGTH_HELP}.")
@click.option("--output-len", default="128", show_default=True, help="Output tokens, same forms as --prompt-len.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Sizing: Poisson requests/s; finds the fewest devices (1..N) and the layout meeting the SLO.")
@click.option("--concurrency", type=click.IntRange(1), default=None,
              help="Sizing with a closed loop of this many clients instead of --rate.")
@click.option("--rates", callback=_rates, default=None,
              help="Capacity: comma-separated Poisson rates to sweep on N devices (default: 10 rates up to ~1.5x "
                   "a rough capacity estimate from the profile).")
@click.option("--requests", default=400, show_default=True, type=click.IntRange(10),
              help="Requests per simulation.")
@click.option("--min-duration-s", default=30.0, show_default=True, type=click.FloatRange(0),
              help="Open loop: simulate at least this many seconds of arrivals per point (rate x this many "
                   "requests, when more than --requests), so high rates reach their steady load.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for lengths and arrival times.")
@click.option("--slo-ttft-ms", required=True, type=click.FloatRange(min=0, min_open=True),
              help="Time-to-first-token limit (ms).")
@click.option("--slo-tpot-ms", required=True, type=click.FloatRange(min=0, min_open=True),
              help="Time-per-output-token limit (ms).")
@click.option("--target", default=0.9, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="Fraction of requests that must meet both limits.")
@click.option("--priorities", default=None,
              help=f"Priority classes of the requests (as `priority` with --scheduling-policy priority): "
                   f"{PRIORITIES_HELP}. Default: every request priority 0.")
@click.option("--class-prompt-len", multiple=True, metavar="PRIORITY=LENGTH",
              help="A priority class's own prompt tokens (a length as --prompt-len), e.g. 0=128; once per class. "
                   "Default: --prompt-len.")
@click.option("--class-output-len", multiple=True, metavar="PRIORITY=LENGTH",
              help="A priority class's own output tokens, as --class-prompt-len. Default: --output-len.")
@click.option("--slo-priority", type=int, default=None,
              help="The SLO holds for requests of this priority or a lower value; the others are served best "
                   "effort (default: for every request).")
@click.option("--chunk-tokens", type=click.IntRange(1), default=None,
              help="Prompt tokens per chunked-prefill step (default: the profile's serving.chunk_tokens).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for plan.json, plan.md, plan.png.")
def plan_command(profile_path, devices, prompt_len, output_len, rate, concurrency, rates, requests, min_duration_s,
                 seed, slo_ttft_ms, slo_tpot_ms, target, priorities, class_prompt_len, class_output_len, slo_priority,
                 chunk_tokens, out):
    """Simulate every serving layout on N devices and recommend one that meets the SLO.

    Layouts: every xPyD split (x prefill + y decode workers, x + y = N), N co-located replicas
    ("colocated Nx1"), one co-located worker on all N devices ("colocated 1xN", only when the
    profile gives its speedup), and the same two with chunked prefill.

    \b
    Capacity (default, or --rates): the highest Poisson rate each layout sustains on N devices
      with >= --target of requests meeting TTFT and TPOT; recommends the highest.
    Sizing (--rate or --concurrency): the fewest devices, and the layout on them, meeting the
      target at that load.
    Priority classes (--priorities, --slo-priority): the SLO for the urgent classes only, the
      rest served best effort, as the serving code orders and preempts them; a class may have
      lengths of its own (--class-prompt-len, --class-output-len).

    \b
    Example:
      tandem plan --profile docs/planning/profiles/llama3-8b-h100.json --devices 8 \\
        --prompt-len 512 --output-len 128 --slo-ttft-ms 200 --slo-tpot-ms 50 --out plan-chat
    """
    from planner.plan import PlanRequest, plan
    from planner.profile import ProfileError, load_profile
    from planner.plan_report import write_report
    from planner.plan_workload import (ClosedLoop, Poisson, Workload, WorkloadError, parse_length, parse_priorities,
                                       with_class_lengths)

    given = [n for n, v in (("--rate", rate), ("--concurrency", concurrency), ("--rates", rates)) if v is not None]
    if len(given) > 1:
        raise click.UsageError(f"give at most one of --rate, --concurrency, --rates (got {', '.join(given)})")
    try:
        profile = load_profile(profile_path)
        arrivals = ClosedLoop(concurrency=concurrency) if concurrency else Poisson(rate=rate or 1.0)
        classes = with_class_lengths(parse_priorities(priorities) if priorities is not None else (),
                                     class_prompt_len, class_output_len)
        workload = Workload(prompt=parse_length(prompt_len), output=parse_length(output_len), arrivals=arrivals,
                            requests=requests, seed=seed, priorities=classes)
        req = PlanRequest(devices=devices, workload=workload, slo_ttft_s=slo_ttft_ms / 1e3,
                          slo_tpot_s=slo_tpot_ms / 1e3, target=target, rates=rates,
                          sizing=rate is not None or concurrency is not None, chunk_tokens=chunk_tokens,
                          min_duration_s=min_duration_s, slo_priority=slo_priority)
    except (ProfileError, WorkloadError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    doc = plan(profile, req, log=lambda m: click.echo(m, err=True))
    paths = write_report(doc, out)
    rec = doc["recommendation"]
    click.echo(f"recommendation: {rec['layout'] or 'none'}: {rec['reason']}")
    click.echo("wrote " + ", ".join(paths))


@click.command("profile")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where to write the profile JSON.")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="smollm2-135m, a .gguf file, a Hugging Face folder, a role engine or an engines folder "
                   "(prefill/ + decode/).")
@click.option("--name", default=None, help="The profile's name (default: model and machine).")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1),
              help="Torch threads of one worker: one device of the profile (1 = one core per worker).")
@click.option("--scaling-devices", default=None,
              help="Comma-separated device counts N for the profile's `scaling` (one worker with N x --threads "
                   "threads); default: powers of two from 2 while N x --threads fits the cores. 'none': no scaling.")
@click.option("--quick", is_flag=True, help="Fewer, smaller points (well under a minute on 2 cores).")
@click.option("--kv-bytes", default=256 << 20, show_default=True, type=click.IntRange(16 << 20),
              help="KV pool of the engine while measuring (bounds the decode points' context).")
@click.option("--handoff-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="KV handoff throughput in GB/s (gigabytes/s) to record, e.g. from scripts/bench_handoff.py; "
                   "default: measure a memcpy stand-in.")
@click.option("--handoff-latency-ms", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Fixed handoff latency per transfer (ms).")
@click.option("--frontdoor-ttft-ms", default=1.5, show_default=True, type=click.FloatRange(0),
              help="Front-door overhead on the first token (ms), as scripts/bench_frontdoor.py measured.")
@click.option("--frontdoor-per-token-ms", default=0.1, show_default=True, type=click.FloatRange(0),
              help="Front-door overhead per output token (ms).")
@click.option("--served", is_flag=True,
              help="Also measure what serving adds to a step: serve each worker shape of this process's cores "
                   "with tandem serve and time bursts of streams (about 1 minute per shape; planner/served.py).")
@click.option("--served-onto", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Measure only the served part and add it to this profile (written to --out); implies --served.")
def profile_command(out, model, name, threads, scaling_devices, quick, kv_bytes, handoff_gbps, handoff_latency_ms,
                    frontdoor_ttft_ms, frontdoor_per_token_ms, served, served_onto):
    """Measure a hardware profile of this machine and the PyTorch engine (about 1-3 minutes; --quick less).

    Times prefill passes over several token counts and batch shapes and decode steps over several
    batch sizes and contexts, fits the profile's models, and records the handoff and front-door
    figures. The result is the input of `tandem plan --profile`. With --served it then serves the
    model on this process's cores and records what serving adds to each step.
    """
    from planner.measure import MeasureOptions, measure_profile
    from planner.profile import dump_profile, load_profile

    def log(message: str) -> None:
        click.echo(message, err=True)

    if (served or served_onto) and threads != 1:
        raise click.ClickException(f"--served serves one core per device; got --threads {threads}")
    try:
        if served_onto:
            profile = load_profile(served_onto)
        else:
            opts = MeasureOptions(model=model, name=name, threads=threads, scaling=scaling_devices,
                                  quick=quick, kv_bytes=kv_bytes, handoff_gbps=handoff_gbps,
                                  handoff_latency_s=handoff_latency_ms / 1e3, frontdoor_ttft_s=frontdoor_ttft_ms / 1e3,
                                  frontdoor_per_token_s=frontdoor_per_token_ms / 1e3)
            profile = measure_profile(opts, log=log)
        if served or served_onto:
            profile = _with_served(profile, model, log)
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    with open(out, "w", encoding="utf-8") as f:
        f.write(dump_profile(profile))
    click.echo(f"wrote {out}")


def _with_served(profile, model: str, log):
    """The profile with its `served` part measured on this process's cores (one core per device)."""
    import os

    from cli.bench_cmd import _tokenizer
    from clients.bench.served_steps import ServedOptions, measure_served

    opts = ServedOptions(model=model, cpus=tuple(sorted(os.sched_getaffinity(0))))
    return profile.model_copy(update={"served": measure_served(profile, opts, _tokenizer(None), log)})
