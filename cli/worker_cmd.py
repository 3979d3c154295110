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

import logging
import os
import signal
import sys
import tempfile
import threading

import click

from cli.options import name_path_pairs
from tandem import __version__
from tandem.logs import FORMATS, setup_logging
from tandem.modes import HandoffMode
from tandem.roles import Role
from tandem.wire import WIRE
from ops.startup import one_line


def _env(name: str) -> dict:
    """The option's environment variable, TANDEM_WORKER_<name>, shown in --help."""
    return {"envvar": f"TANDEM_WORKER_{name}", "show_envvar": True}


@click.command("worker")
@click.option("--role", type=click.Choice([r.value for r in Role]), required=True, **_env("ROLE"))
@click.option("--engines", required=True, help="Folder with prefill/ and decode/ engines (from tandem build).",
              **_env("ENGINES"))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).",
              **_env("HOST"))
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True, **_env("GRPC_PORT"))
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True, **_env("HTTP_PORT"))
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True, **_env("METRICS_PORT"))
@click.option("--transport", type=click.Choice(["shm", "cuda_ipc", "nixl", "auto"]), default="auto", show_default=True,
              help="decode (and prefill with --handoff pull): how peers reach its pool (auto: shm or cuda_ipc on "
                   "this host, NIXL from others).",
              **_env("TRANSPORT"))
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the engine runs (auto: CUDA when visible).", **_env("DEVICE"))
@click.option("--gpu", type=click.IntRange(0), default=0, show_default=True,
              help="cuda: which visible GPU (as numbered under this process's CUDA_VISIBLE_DEVICES).", **_env("GPU"))
@click.option("--kv-pool-bytes", type=click.IntRange(1 << 20), default=None, **_env("KV_POOL_BYTES"),
              help="KV pool size. Default: sized to GPU memory on a GPU, the decode profile's on the CPU.")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=None,
              **_env("GPU_MEMORY_UTILIZATION"),
              help="cuda: the fraction of the GPU's memory this worker takes; what its weights leave is its KV pool "
                   "(vLLM's flag; default 0.9 unless --kv-pool-bytes).")
@click.option("--max-num-seqs", type=click.IntRange(1, 4096), default=None, **_env("MAX_NUM_SEQS"),
              help="decode/generate: the most requests run at once (default: the decode profile's; generate: 64).")
@click.option("--max-num-batched-tokens", type=click.IntRange(16), default=None, **_env("MAX_NUM_BATCHED_TOKENS"),
              help="The most prompt tokens one prefill pass takes (default: the prefill profile's).")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="Torch threads (default: usable cores).",
              **_env("THREADS"))
@click.option("--chunk-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="generate: chunked-prefill tokens per step (0: prefill first).", **_env("CHUNK_TOKENS"))
@click.option("--handoff", type=click.Choice([m.value for m in HandoffMode]), default=HandoffMode.PUSH.value, show_default=True,
              help="prefill: pull keeps each prompt's K/V in its own pool for decode to read (over --transport).",
              **_env("HANDOFF"))
@click.option("--lora-modules", multiple=True, callback=name_path_pairs, **_env("LORA_MODULES"),
              help="LoRA adapters as NAME=PATH, repeated: the orchestrator's (tandem serve --lora-modules).")
@click.option("--tls-cert", default=None, help="PEM certificate: Triton's gRPC serves TLS (needed beyond loopback "
              "for the orchestrator to send the secret).", **_env("TLS_CERT"))
@click.option("--tls-key", default=None, help="PEM private key of --tls-cert.", **_env("TLS_KEY"))
@click.option("--workdir", default=None, help="Where the model repository (and logs) go.", **_env("WORKDIR"))
@click.option("--log-file/--log-stdout", default=False, help="Triton's log to a file in --workdir, or to stdout.",
              **_env("LOG_FILE"))
@click.option("--log-format", type=click.Choice(FORMATS), default="text", show_default=True,
              help="This command's own lines (Triton's keep Triton's format).", **_env("LOG_FORMAT"))
@click.option("--otlp-endpoint", default=None, **_env("OTLP_ENDPOINT"),
              help="OpenTelemetry traces: OTLP URL of a collector (HTTP, or gRPC with OTEL_EXPORTER_OTLP_PROTOCOL="
                   "grpc; default: the OTEL_EXPORTER_OTLP_* variables; off when none is set). Needs the otel extra.")
def worker_command(role, engines, host, grpc_port, http_port, metrics_port, transport, device, gpu, kv_pool_bytes,
                   gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
                   threads, chunk_tokens, handoff, lora_modules, tls_cert, tls_key, workdir, log_file, log_format,
                   otlp_endpoint):
    """Run one role's Triton instance on this node until stopped.

    Every option can be set by its TANDEM_WORKER_* variable (shown in each option's help by --help)."""
    from builder.repo import RenderError, RepoOptions, render_repo
    from engine.lora_files import check_modules
    from engine.shm_region import remove_orphaned_triton_regions, remove_stale_segments
    from ops.door_security import port_refusal
    from ops.gpu_plan import one_worker_pool
    from ops.triton_process import TritonError, TritonServer
    from tandem.devices import DeviceError, resolve_device
    from tandem.secret import SecretError, is_loopback, load_secret
    from tandem.tracing import TraceConfig, TraceConfigError

    role = Role(role)
    setup_logging(log_format)
    say = logging.getLogger("tandem.worker").info
    if (tls_cert is None) != (tls_key is None):
        raise click.ClickException("--tls-cert and --tls-key go together")
    for what, port in (("gRPC", grpc_port), ("HTTP", http_port), ("metrics", metrics_port)):
        why = port_refusal(host, port)
        if why:
            raise click.ClickException(f"the worker's {what} port cannot be used: {why} (choose another with "
                                       f"--{what.lower()}-port)")
    if gpu_memory_utilization is not None and kv_pool_bytes is not None:
        raise click.ClickException("--gpu-memory-utilization sizes the KV pool from what the weights leave, "
                                   "--kv-pool-bytes gives it in bytes; give one of the two")
    try:
        on_gpu = resolve_device(device) == "cuda" and resolve_device("cuda", [gpu]) == "cuda"  # --gpu must exist
        if gpu_memory_utilization is not None and not on_gpu:
            raise DeviceError("--gpu-memory-utilization sizes a KV pool on a GPU, but this worker runs on the CPU; "
                              "size it with --kv-pool-bytes")
        if on_gpu and kv_pool_bytes is None:
            kv_pool_bytes = one_worker_pool(engines, role, gpu, gpu_memory_utilization)
        load_secret(required=not is_loopback(host))  # checked here; the models read it themselves
        traced = TraceConfig.from_env(os.environ, otlp_endpoint, role)
        check_modules(lora_modules or {})
    except (DeviceError, SecretError, TraceConfigError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if not is_loopback(host) and tls_cert is None:
        logging.getLogger("tandem.worker").warning(
            "listening on %s without --tls-cert: an orchestrator beyond this host will not send it the "
            "deployment secret (it refuses to send it in the clear)", host)
    remove_stale_segments()
    remove_orphaned_triton_regions()
    workdir = workdir or tempfile.mkdtemp(prefix=f"tandem-worker-{role}-")
    repo = os.path.join(workdir, "model_repository")
    try:
        render_repo(engines, repo, RepoOptions(transport=transport, kv_pool_bytes=kv_pool_bytes, chunk_tokens=chunk_tokens,
                                               threads=threads or len(os.sched_getaffinity(0)), handoff=handoff,
                                               gpus=((role, gpu),) if on_gpu else (),
                                               lora_modules=tuple((lora_modules or {}).items()),
                                               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens))
    except RenderError as e:
        raise click.ClickException(str(e)) from None
    server = TritonServer(repo, (role,), name=role, host=host, grpc_port=grpc_port, http_port=http_port,
                          metrics_port=metrics_port, log_dir=workdir, log_stdout=not log_file,
                          tls=(tls_cert, tls_key) if tls_cert else None,
                          env={"TANDEM_LOG_FORMAT": log_format, **(traced.worker_env() if traced else {})})
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
        raise click.ClickException(one_line(e)) from None
    say(f"worker {role} ready: grpc {host}:{grpc_port}{' (TLS)' if tls_cert else ''} http {host}:{http_port} "
        f"(Tandem {__version__}, wire schema {WIRE})")
    code = server.proc.wait()
    if not stopping.is_set():
        server.stop()  # it died by itself: reap its group and its shared memory, then say so
        logging.getLogger("tandem.worker").error("worker %s: Triton exited with %s", role, code)
        sys.exit(code if code > 0 else 1)
