"""The `tandem` command line. Each command lives beside the code it drives and imports it lazily."""

from __future__ import annotations

import click

from tandem import __version__
from tandem.wire import WIRE


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tandem", message="%(prog)s, version %(version)s (wire schema " + WIRE
                      + ": orchestrator and workers must match)")
def main() -> None:
    """Tandem: prefill/decode disaggregated LLM serving on Triton Inference Server."""


def _register() -> None:
    from cli.build_cmd import build_command, repo_command
    from cli.generate_cmd import generate_command
    from cli.batch_cmd import batch_command
    from cli.bench_cmd import bench_group
    from cli.cache_cmd import cache_group
    from cli.chaos_cmd import chaos_command
    from cli.chat_cmd import chat_command
    from cli.serve_cmd import serve_command
    from cli.status_cmd import status_command
    from cli.worker_cmd import worker_command
    from cli.workers_cmd import workers_group
    from cli.plan_cmd import plan_command, profile_command

    main.add_command(generate_command)
    main.add_command(build_command)
    main.add_command(repo_command)
    main.add_command(workers_group)
    main.add_command(worker_command)
    main.add_command(serve_command)
    main.add_command(status_command)
    main.add_command(chat_command)
    main.add_command(batch_command)
    main.add_command(bench_group)
    main.add_command(cache_group)
    main.add_command(chaos_command)
    main.add_command(profile_command)
    main.add_command(plan_command)


_register()


if __name__ == "__main__":
    main()
