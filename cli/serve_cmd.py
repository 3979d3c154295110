"""`tandem serve`: the whole stack, until Ctrl-C (`tandem chat`, cli/chat_cmd.py, talks to it)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
from collections.abc import Callable

import click

from cli.options import name_path_pairs
from frontdoor.reasoning_text import PARSER_NAMES as REASONING_PARSERS
from frontdoor.tool_parsers import PARSER_NAMES
from tandem.logs import FORMATS, setup_logging
from tandem.modes import HandoffMode, Mode
from ops.startup import StartupError, one_line


def _env(name: str) -> dict:
    """The option's environment variable, TANDEM_<name>, shown in --help."""
    return {"envvar": f"TANDEM_{name}", "show_envvar": True}


def _json(needed: str, example: str, fits: Callable[[object], bool]):
    """A click callback: the option's text read as JSON that `fits` (None: not given); `needed` says what
    fits, `example` shows it."""
    def read(ctx, param, value: str | None):
        if value is None:
            return None
        try:
            got = json.loads(value)
        except ValueError as e:
            raise click.BadParameter(f"not JSON: {e}") from None
        if not fits(got):
            raise click.BadParameter(f"{needed} is needed, e.g. {example}")
        return got
    return read


_JSON_OBJECT = _json("a JSON object", "'{\"temperature\": 0.5}'", lambda v: isinstance(v, dict))
_JSON_STRINGS = _json("a JSON list of strings", "'[\"https://chat.example.com\"]'",
                      lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))


@click.command("serve")
@click.option("--model", default=None, **_env("MODEL"),
              help="smollm2-135m, a checkpoint path, a Hugging Face repo id (org/name) in the local Hugging Face "
                   "cache, or an engines folder (prefill/ + decode/).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None, **_env("DTYPE"),
              help="Weights and KV of engines built from --model (default auto: bfloat16 on CUDA, else float32).")
@click.option("--config", "config_path", default=None, **_env("CONFIG"),
              help="Deployment YAML (flags and TANDEM_* variables given here override it).")
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=None, **_env("MODE"))
@click.option("--prefill", type=click.IntRange(0, 64), default=None, **_env("PREFILL"),
              help="Local prefill workers (default 1).")
@click.option("--decode", type=click.IntRange(0, 64), default=None, **_env("DECODE"),
              help="Local decode workers (default 1).")
@click.option("--replicas", type=click.IntRange(1, 64), default=None, **_env("REPLICAS"),
              help="colocated/chunked: co-located workers, each on its own cores (default 1).")
@click.option("--transport", type=click.Choice(["shm", "cuda_ipc", "nixl", "auto"]), default=None, **_env("TRANSPORT"),
              help="KV handoff: shm (one host, CPU pool), cuda_ipc (one host, GPU pool), nixl, auto (the one-host "
                   "one, and NIXL for other hosts). Default: the one-host transport for the decode device.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None, **_env("DEVICE"),
              help="Where local workers run (default auto: CUDA when visible); per role in the deployment file.")
@click.option("--handoff", type=click.Choice([m.value for m in HandoffMode]), default=None, **_env("HANDOFF"),
              help="KV handoff: push (prefill writes into decode's pages, default) or pull (decode reads them).")
@click.option("--backend", type=click.Choice(["torch", "tensorrt-llm"]), default=None, **_env("BACKEND"),
              help="Role engines: Tandem's own (torch, default) or TensorRT-LLM's (`tandem build --backend "
                   "tensorrt-llm`; disaggregated, its own pull, CUDA). Not yet run with TensorRT-LLM or on a GPU.")
@click.option("--router", type=click.Choice(["least-loaded", "round-robin", "kv-aware"]), default=None,
              **_env("ROUTER"))
@click.option("--host", default=None, **_env("HOST"), help="Front-door address (default 127.0.0.1).")
@click.option("--grpc-port", type=click.IntRange(0, 65535), default=None, **_env("GRPC_PORT"),
              help="Triton gRPC protocol (default 8001).")
@click.option("--http-port", "--port", "http_port", type=click.IntRange(0, 65535), default=None, **_env("HTTP_PORT"),
              help="OpenAI HTTP, /health, /metrics (default 8000; --port as vLLM's).")
@click.option("--model-name", default=None, **_env("MODEL_NAME"),
              help="The Triton model name on gRPC / KServe HTTP (default ensemble).")
@click.option("--served-model-name", multiple=True, **_env("SERVED_MODEL_NAME"),
              help="The OpenAI model id (default: the model's own name, e.g. smollm2-135m); repeated (or the "
                   "variable's space-separated names), the first is the id answers carry and the others aliases.")
@click.option("--chat-template", default=None, **_env("CHAT_TEMPLATE"),
              help="A Jinja chat template file, or the name of one of the model's named templates.")
@click.option("--tool-call-parser", type=click.Choice(PARSER_NAMES), default=None, **_env("TOOL_CALL_PARSER"),
              help="How the model writes tool calls in its text (hermes: <tool_call> blocks; llama3_json: the answer "
                   "is JSON calls separated by ';'; pythonic: the answer is a Python list of calls); lets tool_choice "
                   "\"auto\" (the default with tools) be served. Default: none, \"auto\" refused.")
@click.option("--reasoning-parser", type=click.Choice(REASONING_PARSERS), default=None, **_env("REASONING_PARSER"),
              help="How a thinking model marks its reasoning (deepseek_r1: the template opens <think>, the answer "
                   "reasons until </think>; qwen3: an answer starting with <think>): chat replies carry it apart as "
                   "`reasoning`, the Responses API as a reasoning item. Default: none, all of it content.")
@click.option("--generation-config", default=None, **_env("GENERATION_CONFIG"),
              help="Where the OpenAI doors' sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
                   "max_new_tokens) for fields a request leaves out come from: auto (the model's "
                   "generation_config.json, as vLLM), none, or a file or folder. Default: auto.")
@click.option("--override-generation-config", default=None, callback=_JSON_OBJECT, **_env("OVERRIDE_GENERATION_CONFIG"),
              help="JSON: sampling defaults set on top of the generation config, in its names, e.g. "
                   "'{\"temperature\": 0.5, \"max_new_tokens\": 256}' (as vLLM's flag).")
@click.option("--lora-modules", multiple=True, callback=name_path_pairs, **_env("LORA_MODULES"),
              help="LoRA adapters (PEFT folders) as NAME=PATH, repeated (or the variable's space-separated pairs), "
                   "as vLLM's flag: a request whose model is NAME is answered with that adapter. Torch backend.")
@click.option("--lora-root", default=None, **_env("LORA_ROOT"),
              help="A folder of LoRA adapters that may be loaded and unloaded while serving (vLLM's POST "
                   "/v1/load_lora_adapter and /v1/unload_lora_adapter), only from inside it. Default: off.")
@click.option("--responses-kept", type=click.IntRange(0, 100_000), default=None, **_env("RESPONSES_KEPT"),
              help="How many /v1/responses responses are kept in memory for previous_response_id (default 0).")
@click.option("--max-model-len", type=click.IntRange(2), default=None, **_env("MAX_MODEL_LEN"),
              help="The most tokens (prompt + answer) one request may use; longer ones are a 400. Default: the "
                   "model's context.")
@click.option("--max-num-seqs", type=click.IntRange(1, 4096), default=None, **_env("MAX_NUM_SEQS"),
              help="The most requests a decode (or co-located) worker runs at once; more wait their turn there "
                   "(vLLM's flag). Default: the decode engine's profile (tandem build), 64 co-located.")
@click.option("--max-num-batched-tokens", type=click.IntRange(16), default=None, **_env("MAX_NUM_BATCHED_TOKENS"),
              help="The most prompt tokens one prefill pass takes; a longer prompt goes in chunks (vLLM's flag). "
                   "Default: the prefill engine's profile.")
@click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]), default=None,
              **_env("SCHEDULING_POLICY"),
              help="priority: a request's `priority` (lower first) orders what waits for a prefill pass or a decode "
                   "batch (vLLM's flag). Default fcfs: first come, first served, and a non-zero priority is refused.")
@click.option("--priority-levels", type=int, default=None, **_env("PRIORITY_LEVELS"),
              help="With --scheduling-policy priority: the Triton priority levels a KServe request may name (1 the "
                   "highest); give --default-priority-level with it. Default: 2^32-1 levels, default level 2^31.")
@click.option("--default-priority-level", type=int, default=None, **_env("DEFAULT_PRIORITY_LEVEL"),
              help="The level of a request naming none (Tandem's priority 0; level k is priority k minus it).")
@click.option("--kv-pool-bytes", type=click.IntRange(1 << 20), default=None, **_env("KV_POOL_BYTES"),
              help="Decode KV pool per worker. Default: sized to GPU memory on GPUs, the decode profile's on CPUs.")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=None,
              **_env("GPU_MEMORY_UTILIZATION"),
              help="GPUs: the fraction of each GPU's memory its local workers take together; what their weights "
                   "leave is shared by their KV pools (vLLM's flag; default 0.9 unless --kv-pool-bytes).")
@click.option("--chunk-tokens", type=click.IntRange(1), default=None, **_env("CHUNK_TOKENS"),
              help="Chunked mode: prompt tokens per step.")
@click.option("--api-key-file", default=None, **_env("API_KEY_FILE"),
              help="API keys, one a line; TANDEM_API_KEY adds one. Required beyond loopback.")
@click.option("--no-api-key", is_flag=True, default=None, **_env("NO_API_KEY"),
              help="Serve beyond loopback without API keys (anyone who reaches the doors may use them).")
@click.option("--prefix-cache-per-api-key", is_flag=True, default=None, **_env("PREFIX_CACHE_PER_API_KEY"),
              help="Each key holder's requests (keys of one name are one holder) share cached prefixes only among "
                   "themselves (needs API keys).")
@click.option("--allowed-origins", default=None, callback=_JSON_STRINGS, **_env("ALLOWED_ORIGINS"),
              help="JSON list: web pages of these origins may call the HTTP door from a browser (CORS), e.g. "
                   "'[\"https://chat.example.com\"]'; '[\"*\"]': any. Default: none.")
@click.option("--allowed-methods", default=None, callback=_JSON_STRINGS, **_env("ALLOWED_METHODS"),
              help="JSON list: the methods such pages may use (default '[\"*\"]': any).")
@click.option("--allowed-headers", default=None, callback=_JSON_STRINGS, **_env("ALLOWED_HEADERS"),
              help="JSON list: the request headers such pages may send (default '[\"*\"]': any).")
@click.option("--allow-credentials", is_flag=True, default=None, **_env("ALLOW_CREDENTIALS"),
              help="Such pages' calls may carry credentials (cookies, TLS client certificates).")
@click.option("--tls-cert", default=None, **_env("TLS_CERT"), help="PEM certificate: both doors serve TLS.")
@click.option("--tls-key", default=None, **_env("TLS_KEY"), help="PEM private key of --tls-cert.")
@click.option("--tls-client-ca", default=None, **_env("TLS_CLIENT_CA"),
              help="PEM CA: clients must present a certificate it signed (mutual TLS).")
@click.option("--worker-tls-ca", default=None, **_env("WORKER_TLS_CA"),
              help="PEM CA of the workers' certificates: the orchestrator talks to them over TLS.")
@click.option("--worker-tls-server-name", default=None, **_env("WORKER_TLS_SERVER_NAME"),
              help="The name in the workers' certificates (when they are dialled by address).")
@click.option("--otlp-endpoint", default=None, **_env("OTLP_ENDPOINT"),
              help="OpenTelemetry traces: OTLP URL of a collector, e.g. http://127.0.0.1:4318 (gRPC with "
                   "OTEL_EXPORTER_OTLP_PROTOCOL=grpc: http://127.0.0.1:4317; default: the OTEL_EXPORTER_OTLP_* "
                   "variables; off when none is set). Needs the otel extra.")
@click.option("--log-format", type=click.Choice(FORMATS), default="text", show_default=True, **_env("LOG_FORMAT"),
              help="json: one object per line, each with the request id of its request.")
@click.option("--workdir", default=None, **_env("WORKDIR"), help="Where worker logs and the model repository go.")
def serve_command(model, dtype, config_path, mode, prefill, decode, replicas, transport, device, handoff, backend,
                  router, host, grpc_port, http_port, model_name, served_model_name, chat_template, tool_call_parser,
                  reasoning_parser, generation_config, override_generation_config, lora_modules, lora_root,
                  responses_kept, max_model_len, max_num_seqs, max_num_batched_tokens, scheduling_policy,
                  priority_levels, default_priority_level,
                  kv_pool_bytes, gpu_memory_utilization, chunk_tokens, api_key_file, no_api_key, prefix_cache_per_api_key,
                  allowed_origins, allowed_methods, allowed_headers, allow_credentials, tls_cert, tls_key,
                  tls_client_ca, worker_tls_ca, worker_tls_server_name,
                  otlp_endpoint, log_format, workdir):
    """Serve a model: prefill and decode workers in Triton, behind Triton gRPC and OpenAI HTTP.

    Every option can be set by its TANDEM_* variable (shown in each option's help by --help)."""
    from ops.deployment import DeploymentError, load_deployment
    from ops.stack import local_gpus

    overrides = {k: v for k, v in {
        "mode": mode, "dtype": dtype, "device": device, "prefill.count": prefill, "decode.count": decode, "replicas": replicas,
        "transport": transport, "handoff.mode": handoff, "backend": backend,
        "router": router, "front_door.served_model_name": list(served_model_name) or None,
        "front_door.chat_template": chat_template, "front_door.tool_call_parser": tool_call_parser,
        "front_door.reasoning_parser": reasoning_parser, "front_door.generation_config": generation_config,
        "front_door.override_generation_config": override_generation_config, "lora_modules": lora_modules,
        "lora_loading.root": lora_root, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "scheduling_policy": scheduling_policy, "priority_levels": priority_levels,
        "default_priority_level": default_priority_level,
        "front_door.responses_kept": responses_kept, "limits.max_model_len": max_model_len,
        "front_door.host": host, "front_door.grpc_port": grpc_port, "front_door.http_port": http_port,
        "front_door.model_name": model_name, "kv_pool_bytes": kv_pool_bytes,
        "gpu_memory_utilization": gpu_memory_utilization, "chunk_tokens": chunk_tokens,
        "front_door.api_key_file": api_key_file, "front_door.no_api_key": no_api_key,
        "prefix_cache.per_api_key": prefix_cache_per_api_key, "front_door.cors.allowed_origins": allowed_origins,
        "front_door.cors.allowed_methods": allowed_methods, "front_door.cors.allowed_headers": allowed_headers,
        "front_door.cors.allow_credentials": allow_credentials,
        "front_door.tls.cert": tls_cert, "front_door.tls.key": tls_key, "front_door.tls.client_ca": tls_client_ca,
        "worker_tls.ca": worker_tls_ca, "worker_tls.server_name": worker_tls_server_name,
        "tracing.otlp_endpoint": otlp_endpoint,
    }.items() if v is not None}
    if model is not None:
        is_engines = any(os.path.isfile(os.path.join(model, "prefill", f)) for f in ("manifest.json",
                                                                                     "llm_api_options.yaml"))
        overrides["engines" if is_engines else "model"] = model
    setup_logging(log_format)
    os.environ["TANDEM_LOG_FORMAT"] = log_format  # the local workers' stubs log in it too (engine/triton/common.py)
    try:
        dep = load_deployment(config_path, overrides)
        local_gpus(dep)  # CUDA asked for and absent: refused here, before anything starts
        asyncio.run(_serve(dep, workdir, config_path, overrides, log_format))
    except DeploymentError as e:
        raise click.ClickException(str(e)) from None
    except StartupError as e:  # a worker's Triton would not start: its cause in one line
        raise click.ClickException(one_line(e)) from None


async def _reload(stack, config_path, overrides) -> None:
    """SIGHUP: read the deployment file again: its API keys and its remote workers."""
    from ops.deployment import DeploymentError, load_deployment

    try:
        said = await stack.reload(load_deployment(config_path, overrides))
    except DeploymentError as e:
        logging.getLogger("tandem.serve").warning("reload refused, keeping the running deployment: %s", e)
        return
    logging.getLogger("tandem.serve").info("reloaded: %s", said)


async def _serve(dep, workdir, config_path=None, overrides=None, log_format: str = "text") -> None:
    from ops.stack import Stack, trace_config

    say = logging.getLogger("tandem.serve").info if log_format == "json" else lambda m: click.echo(m, err=True)
    stack = Stack(dep, workdir, log=say)
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
        web = "https" if fd.tls else "http"
        say(f"serving '{stack.served.served_name}' ({dep.mode}); Triton gRPC {fd.host}:{fd.grpc_port} "
            f"(model '{fd.model_name}'{', TLS' if fd.tls else ''}), OpenAI HTTP {web}://{fd.host}:{fd.http_port}/v1, "
            f"metrics {web}://{fd.host}:{fd.http_port}/metrics; API keys "
            f"{'required' if stack.security.keys else 'off'}")
        if stack.tracer.enabled:
            traced = trace_config(dep)
            say(f"traces: OTLP ({traced.protocol}) to {traced.url}")
        path = stack.service.path
        say("ready" if path.ready() else "ready; waiting for remote workers (/health says 503 until each role has one, "
            "the log says why a worker is not ready)")
        await stop.wait()
        say(f"draining (up to {dep.health.drain_grace_s:.0f}s for requests in flight) ...")
        await stack.drain(dep.health.drain_grace_s)
        say("stopping ...")
    finally:
        await stack.stop()
