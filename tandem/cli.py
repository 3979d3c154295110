"""The `tandem` command line. Each command lives beside the code it drives and imports it lazily."""

from __future__ import annotations

import click

from tandem import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tandem")
def main() -> None:
    """Tandem: prefill/decode disaggregated LLM serving on Triton Inference Server."""


def _register() -> None:
    from builder.cli import build_command, repo_command
    from engine.cli import generate_command
    from orchestrator.bench.cli import bench_group
    from orchestrator.cache_cli import cache_group
    from orchestrator.chaos.cli import chaos_command
    from orchestrator.serve_cli import chat_command, serve_command
    from orchestrator.worker_cli import worker_command
    from orchestrator.workers_cli import workers_group
    from planner.cli import plan_command, profile_command

    main.add_command(generate_command)
    main.add_command(build_command)
    main.add_command(repo_command)
    main.add_command(workers_group)
    main.add_command(worker_command)
    main.add_command(serve_command)
    main.add_command(chat_command)
    main.add_command(bench_group)
    main.add_command(cache_group)
    main.add_command(chaos_command)
    main.add_command(profile_command)
    main.add_command(plan_command)


_register()


if __name__ == "__main__":
    main()
