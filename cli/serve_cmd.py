"""`tandem serve` (the whole stack, until Ctrl-C) and `tandem chat` (a streaming client for it)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import urllib.error
import urllib.request

import click


@click.command("serve")
@click.option("--model", default=None, help="smollm2-135m, a checkpoint path, or an engines folder (prefill/ + decode/).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
              help="Weights and KV of engines built from --model (default auto: bfloat16 on CUDA, else float32).")
@click.option("--config", "config_path", default=None, help="Deployment YAML (flags given here override it).")
@click.option("--mode", type=click.Choice(["disaggregated", "colocated", "chunked"]), default=None)
@click.option("--prefill", type=click.IntRange(0, 64), default=None, help="Local prefill workers (default 1).")
@click.option("--decode", type=click.IntRange(0, 64), default=None, help="Local decode workers (default 1).")
@click.option("--replicas", type=click.IntRange(1, 64), default=None,
              help="colocated/chunked: co-located workers, each on its own cores (default 1).")
@click.option("--transport", type=click.Choice(["shm", "cuda_ipc", "nixl", "auto"]), default=None,
              help="KV handoff: shm (one host, CPU pool), cuda_ipc (one host, GPU pool), nixl, auto (the one-host "
                   "one, and NIXL for other hosts). Default: the one-host transport for the decode device.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="Where local workers run (default auto: CUDA when visible); per role in the deployment file.")
@click.option("--handoff", type=click.Choice(["push", "pull"]), default=None,
              help="KV handoff: push (prefill writes into decode's pages, default) or pull (decode reads them).")
@click.option("--router", type=click.Choice(["least-loaded", "round-robin", "kv-aware"]), default=None)
@click.option("--host", default=None, help="Front-door address (default 127.0.0.1).")
@click.option("--grpc-port", type=click.IntRange(0, 65535), default=None, help="Triton gRPC protocol (default 8001).")
@click.option("--http-port", type=click.IntRange(0, 65535), default=None, help="OpenAI HTTP, /health, /metrics (default 8000).")
@click.option("--model-name", default=None, help="The Triton model name on gRPC / KServe HTTP (default ensemble).")
@click.option("--served-model-name", default=None,
              help="The OpenAI model id (default: the model's own name, e.g. smollm2-135m).")
@click.option("--kv-pool-bytes", type=click.IntRange(1 << 20), default=None, help="Decode KV pool per worker.")
@click.option("--chunk-tokens", type=click.IntRange(1), default=None, help="Chunked mode: prompt tokens per step.")
@click.option("--workdir", default=None, help="Where worker logs and the model repository go.")
def serve_command(model, dtype, config_path, mode, prefill, decode, replicas, transport, device, handoff, router, host,
                  grpc_port, http_port, model_name, served_model_name, kv_pool_bytes, chunk_tokens, workdir):
    """Serve a model: prefill and decode workers in Triton, behind Triton gRPC and OpenAI HTTP."""
    from ops.deployment import DeploymentError, load_deployment
    from ops.stack import local_gpus

    overrides = {k: v for k, v in {
        "mode": mode, "dtype": dtype, "device": device, "prefill.count": prefill, "decode.count": decode, "replicas": replicas,
        "transport": transport, "handoff.mode": handoff,
        "router": router, "front_door.served_model_name": served_model_name,
        "front_door.host": host, "front_door.grpc_port": grpc_port, "front_door.http_port": http_port,
        "front_door.model_name": model_name, "kv_pool_bytes": kv_pool_bytes, "chunk_tokens": chunk_tokens,
    }.items() if v is not None}
    if model is not None:
        is_engines = os.path.isfile(os.path.join(model, "prefill", "manifest.json"))
        overrides["engines" if is_engines else "model"] = model
    try:
        dep = load_deployment(config_path, overrides)
        local_gpus(dep)  # CUDA asked for and absent: refused here, before anything starts
    except DeploymentError as e:
        raise click.ClickException(str(e)) from None
    try:
        asyncio.run(_serve(dep, workdir, config_path, overrides))
    except DeploymentError as e:
        raise click.ClickException(str(e)) from None


async def _reload(stack, config_path, overrides) -> None:
    """SIGHUP: read the deployment file again and follow its remote workers."""
    from ops.deployment import DeploymentError, load_deployment

    try:
        dep = load_deployment(config_path, overrides)
    except DeploymentError as e:
        click.echo(f"reload refused, keeping the running deployment: {e}", err=True)
        return
    await stack.reload(dep)
    click.echo("reloaded the deployment's worker list", err=True)


async def _serve(dep, workdir, config_path=None, overrides=None) -> None:
    from ops.stack import Stack

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stack = Stack(dep, workdir, log=lambda m: click.echo(m, err=True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(_reload(stack, config_path, overrides)))
    try:
        await stack.start()
        gc.collect()
        gc.freeze()  # what start-up made (modules, tokenizer) is never garbage: no 90-ms full collections under load
        fd = dep.front_door
        click.echo(f"serving '{stack.served.served_name}' ({dep.mode}); Triton gRPC {fd.host}:{fd.grpc_port} "
                   f"(model '{fd.model_name}'), "
                   f"OpenAI HTTP http://{fd.host}:{fd.http_port}/v1, metrics http://{fd.host}:{fd.http_port}/metrics",
                   err=True)
        click.echo("ready", err=True)
        await stop.wait()
        click.echo(f"draining (up to {dep.health.drain_grace_s:.0f}s for requests in flight) ...", err=True)
        await stack.drain(dep.health.drain_grace_s)
        click.echo("stopping ...", err=True)
    finally:
        await stack.stop()


@click.command("chat")
@click.argument("message")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="A `tandem serve` HTTP address.")
@click.option("--max-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
def chat_command(message, url, max_tokens, temperature):
    """Ask a running `tandem serve` one question; the answer streams to the terminal."""
    body = json.dumps({"messages": [{"role": "user", "content": message}], "max_tokens": max_tokens,
                       "temperature": temperature, "stream": True}).encode()
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise click.ClickException(chunk["error"]["message"])
                for choice in chunk.get("choices", []):
                    sys.stdout.write(choice.get("delta", {}).get("content") or "")
                    sys.stdout.flush()
    except urllib.error.HTTPError as e:
        raise click.ClickException(f"{e.code}: {e.read().decode(errors='replace')}") from None
    except urllib.error.URLError as e:
        raise click.ClickException(f"cannot reach {url}: {e.reason} (is 'tandem serve' running?)") from None
    click.echo()
