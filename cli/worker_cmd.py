"""`tandem worker`: one role's Triton instance on this node, for deployments across hosts.

    tandem worker --role decode --engines engines/smollm2-135m --host 0.0.0.0 --transport nixl --device cuda

It renders the role's model repository, starts Triton bound to --host, prints
`worker <role> ready: grpc HOST:PORT http HOST:PORT` once the model is ready, and runs until SIGTERM or
SIGINT (then stops Triton cleanly) or until Triton exits (then exits with its code, so a container
runtime or Kubernetes restarts it). Off loopback it requires the deployment secret (TANDEM_SECRET_FILE or
TANDEM_SECRET; tandem/secret.py) and locks Triton's admin APIs. An orchestrator lists it by address
(`prefill.urls` / `decode.urls`, or `dns:`) in its deployment file.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading

import click


@click.command("worker")
@click.option("--role", type=click.Choice(["prefill", "decode", "generate"]), required=True)
@click.option("--engines", required=True, help="Folder with prefill/ and decode/ engines (from tandem build).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).")
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option("--transport", type=click.Choice(["shm", "cuda_ipc", "nixl", "auto"]), default="auto", show_default=True,
              help="decode: how writers reach its pool (auto: shm or cuda_ipc on this host, NIXL from others).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the engine runs (auto: CUDA when visible).")
@click.option("--gpu", type=click.IntRange(0), default=0, show_default=True,
              help="cuda: which visible GPU (as numbered under this process's CUDA_VISIBLE_DEVICES).")
@click.option("--kv-pool-bytes", type=click.IntRange(1 << 20), default=None, help="decode/generate: KV pool size.")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="Torch threads (default: usable cores).")
@click.option("--chunk-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="generate: chunked-prefill tokens per step (0: prefill first).")
@click.option("--handoff", type=click.Choice(["push", "pull"]), default="push", show_default=True,
              help="prefill: pull keeps each prompt's K/V in its own pool for decode to read (one host only).")
@click.option("--workdir", default=None, help="Where the model repository (and logs) go.")
@click.option("--log-file/--log-stdout", default=False, help="Triton's log to a file in --workdir, or to stdout.")
def worker_command(role, engines, host, grpc_port, http_port, metrics_port, transport, device, gpu, kv_pool_bytes,
                   threads, chunk_tokens, handoff, workdir, log_file):
    """Run one role's Triton instance on this node until stopped."""
    from builder.repo import RenderError, RepoOptions, render_repo
    from engine.shm_region import remove_orphaned_triton_regions, remove_stale_segments
    from ops.triton_process import TritonError, TritonServer
    from tandem.devices import DeviceError, resolve_device
    from tandem.secret import SecretError, is_loopback, load_secret

    try:
        on_gpu = resolve_device(device) == "cuda" and resolve_device("cuda", [gpu]) == "cuda"  # --gpu must exist
        load_secret(required=not is_loopback(host))  # checked here; the models read it themselves
    except (DeviceError, SecretError) as e:
        raise click.ClickException(str(e)) from None
    remove_stale_segments()
    remove_orphaned_triton_regions()
    workdir = workdir or tempfile.mkdtemp(prefix=f"tandem-worker-{role}-")
    repo = os.path.join(workdir, "model_repository")
    try:
        render_repo(engines, repo, RepoOptions(transport=transport, kv_pool_bytes=kv_pool_bytes, chunk_tokens=chunk_tokens,
                                               threads=threads or len(os.sched_getaffinity(0)), handoff=handoff,
                                               gpus=((role, gpu),) if on_gpu else ()))
    except RenderError as e:
        raise click.ClickException(str(e)) from None
    server = TritonServer(repo, (role,), name=role, host=host, grpc_port=grpc_port, http_port=http_port,
                          metrics_port=metrics_port, log_dir=workdir, log_stdout=not log_file)
    stopping = threading.Event()

    def stop(signum, _frame):
        stopping.set()
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.launch()
    try:
        server.wait_ready(600.0)
    except TritonError as e:
        server.stop()
        raise click.ClickException(str(e)) from None
    click.echo(f"worker {role} ready: grpc {host}:{grpc_port} http {host}:{http_port}", err=True)
    code = server.proc.wait()
    if not stopping.is_set():
        server.stop()  # it died by itself: reap its group and its shared memory, then say so
        click.echo(f"worker {role}: Triton exited with {code}", err=True)
        sys.exit(code if code > 0 else 1)
