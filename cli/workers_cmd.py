"""`tandem workers up|down|status`: a prefill and a decode Triton instance that outlive the command.

`up` renders the model repository into the state folder, starts the instances (pinned to their own
cores, on 127.0.0.1), waits until both are ready and records them in workers.json; `down` stops
them (the whole process groups) and removes their shared memory.
"""

from __future__ import annotations

import json
import os
import tempfile

import click

STATE_FILE = "workers.json"


def default_state_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"tandem-{os.getuid()}", "workers")


@click.group("workers")
def workers_group() -> None:
    """Start or stop a prefill and a decode Triton instance (without the front door)."""


@workers_group.command("up")
@click.option("--engines", required=True, help="Folder with prefill/ and decode/ engines (from tandem build).")
@click.option("--transport", type=click.Choice(["shm", "nixl"]), default="shm", show_default=True)
@click.option("--kv-pool-bytes", type=click.IntRange(1 << 20), default=None, help="Decode KV pool (default: profile).")
@click.option("--state-dir", default=None, help="Where logs, the repository and workers.json go.")
def up_command(engines, transport, kv_pool_bytes, state_dir):
    from builder.repo import RenderError, RepoOptions
    from ops.triton_process import TritonError
    from ops.local_workers import WorkerSet
    from tandem.roles import Role

    state_dir = state_dir or default_state_dir()
    if os.path.exists(os.path.join(state_dir, STATE_FILE)):
        raise click.ClickException(f"workers are already up (see {state_dir}/{STATE_FILE}); run 'tandem workers down'")
    os.makedirs(state_dir, exist_ok=True)
    ws = WorkerSet(engines, state_dir, {Role.PREFILL: 1, Role.DECODE: 1},
                   RepoOptions(transport=transport, kv_pool_bytes=kv_pool_bytes), detached=True)
    try:
        ws.start()
    except (RenderError, TritonError) as e:
        raise click.ClickException(str(e)) from None
    state = {name: {"role": ws.specs[name].role, "pid": s.proc.pid, "grpc": s.grpc_url, "http": s.http_url, "cpus": list(s.cpus or ()),
                    "log": s.log_path} for name, s in ws.servers.items()}
    with open(os.path.join(state_dir, STATE_FILE), "w") as f:
        json.dump(state, f, indent=2)
    for name, info in state.items():
        click.echo(f"{name}: grpc {info['grpc']}  http {info['http']}  cpus {info['cpus']}  log {info['log']}")


@workers_group.command("down")
@click.option("--state-dir", default=None)
def down_command(state_dir):
    from ops.triton_process import stop_group

    path = os.path.join(state_dir or default_state_dir(), STATE_FILE)
    if not os.path.exists(path):
        raise click.ClickException(f"no workers recorded in {path}")
    with open(path) as f:
        state = json.load(f)
    for name, info in state.items():
        stop_group(int(info["pid"]))
        click.echo(f"{name}: stopped")
    os.remove(path)


@workers_group.command("status")
@click.option("--state-dir", default=None)
def status_command(state_dir):
    path = os.path.join(state_dir or default_state_dir(), STATE_FILE)
    if not os.path.exists(path):
        click.echo("no workers are up")
        return
    with open(path) as f:
        for name, info in json.load(f).items():
            alive = os.path.exists(f"/proc/{info['pid']}")
            click.echo(f"{name}: {'up' if alive else 'DEAD'}  grpc {info['grpc']}  cpus {info['cpus']}")
