"""The deployment file: which workers (xPyD), transport, ports and model. Validated once at start.

    model: smollm2-135m            # or a checkpoint path; engines are built into `engines` if missing
    engines: engines/smollm2-135m  # optional: a folder with prefill/ and decode/ role engines
    backend: torch                 # or tensorrt-llm: TensorRT-LLM role engines (`tandem build --backend
                                   # tensorrt-llm`) in the workers; needs mode disaggregated, handoff pull
                                   # (implied), device cuda for local workers; no transport, gpus or
                                   # local_prefill_tokens (TensorRT-LLM moves the K/V; docs/trtllm.md)
    mode: disaggregated            # or colocated / chunked (the baselines)
    device: auto                   # cpu, cuda, or auto (CUDA when a CUDA device is visible)
    prefill: {count: 1}            # local Triton instances to start ...
    decode: {count: 1, urls: []}   # ... and/or running ones elsewhere (host:grpc_port), or
                                   # dns: name:port (each address it resolves to; re-resolved every 5 s)
                                   # per role: device (default: the top-level one) and the GPUs its
                                   # local workers take in turn, e.g. {count: 2, device: cuda, gpus: [0, 1]}
                                   # (default: every visible GPU; several workers may share one)
    replicas: 1                    # colocated / chunked: co-located workers, each on its own cores
    transport: null                # shm (one host, CPU pool), cuda_ipc (one host, GPU pool), nixl, or auto
                                   # (the one-host one, and NIXL across hosts); null: the one-host one
    router: least-loaded           # or round-robin, or kv-aware (prefix-cache overlap against load)
    local_prefill_tokens: 0        # a decode worker lacking at most this many prompt tokens prefills them
                                   # itself, no prefill worker involved (conditional disaggregation; 0: never)
    prefix_cache: {enabled: true, prefill_pool_bytes: null,   # pages kept for reuse in every worker's pool
                   per_api_key: false}   # true: each API key holder's requests share cached prefixes
                                         # only among themselves
    kv_pool_bytes: null            # each decode (co-located) worker's KV pool; null: sized on GPUs (below), the
                                   # decode profile's on the CPU
    gpu_memory_utilization: null   # GPUs: the fraction of each GPU's memory its workers take together; what
                                   # weights and 1 GiB per process leave is shared equally by their KV pools
                                   # (prefill's too, unless prefix_cache.prefill_pool_bytes); null: 0.9 (vLLM's)
    chunk_tokens: 256              # chunked mode: prompt tokens mixed into each decode step
    max_num_seqs: null             # the most requests a decode (or co-located) worker runs at once; null: the
                                   # decode engine's profile (tandem build), 64 co-located (vLLM's name)
    max_num_batched_tokens: null   # the most prompt tokens one prefill pass takes; null: the prefill profile's
    scheduling_policy: fcfs        # or priority: a request's `priority` (lower first) orders the prompts waiting
                                   # for a prefill pass and the requests waiting for a decode batch (vLLM's)
    priority_levels: null          # priority: Triton's levels on the KServe doors, 1 the highest, with
    default_priority_level: null   # the default level (priority 0); null: 2^32-1 levels, default 2^31
    front_door: {host: 127.0.0.1, grpc_port: 8001, http_port: 8000, model_name: ensemble,
                 served_model_name: null,   # OpenAI model id, or a list (the first, then aliases); null: the model's
                 api_key_file: null,        # keys, one a line (and/or TANDEM_API_KEY); needed beyond loopback ...
                 no_api_key: false,         # ... unless switched off here
                 open_probes: true,         # /health, /metrics, gRPC ServerLive/Ready without a key
                 tls: null,                 # {cert, key, client_ca}: both doors serve TLS (frontdoor/tls.py)
                 chat_template: null,       # a Jinja file, or one of the model's named templates; null: its own
                 tool_call_parser: null,    # hermes, llama3_json, pythonic, mistral: "auto" tool calls; null: refused
                 reasoning_parser: null,    # deepseek_r1, qwen3: <think> text apart as `reasoning`; null: content
                 generation_config: auto,   # sampling defaults: the model's generation_config.json, none, or a path
                 override_generation_config: {},   # fields set on top, e.g. {temperature: 0.5}
                 responses_kept: 0,         # /v1/responses kept in memory for previous_response_id (0: none),
                 responses_kept_bytes: 268435456,   # ... at most this many bytes of them (as JSON)
                 grpc_max_connection_age_s: null,   # gRPC clients reconnect after this (GOAWAY; calls finish
                                            # first), spreading over replicas added since; null: never
                 cors: {allowed_origins: [], allowed_methods: ["*"], allowed_headers: ["*"],
                        allow_credentials: false}}   # web pages of these origins may call ([]: none; ["*"]: any)
    worker_tls: null               # {ca, server_name, cert, key}: TLS to the workers (control/worker_tls.py);
                                   # cert/key: what the local workers serve with
    limits: {max_in_flight: 64, max_queued_tokens: 32768, request_timeout_s: 600, max_model_len: null,
             max_in_flight_per_key: null,   # the most one API key holder may have in flight (null: no own limit)
             receive_timeout_s: 30,   # HTTP: a request arrives whole (head, body) in this, or 408 and closed
             send_timeout_s: 30}      # a client that reads none of its answer this long is cut off, its request
                                      # cancelled (HTTP: the connection aborted; gRPC: the call ends)
    health: {heartbeat_s: 2.0, stall_s: 4.0, stall_restart_s: 10, drain_grace_s: 30}
    handoff: {mode: push, transfer_timeout_s: 30, fence_timeout_s: 60, tokens_per_call: 256}   # data-path timers
                                   # mode push: prefill writes into pages decode reserved; pull: prefill
                                   # holds the K/V in its own pool and decode reads them (shm, cuda_ipc, NIXL READ);
                                   # tokens_per_call: an answer's tokens per decode call (1-256; tandem/call_renewal.py)
    tracing: {otlp_endpoint: null} # OpenTelemetry traces over OTLP, HTTP or gRPC (docs/monitoring.md); null: the
                                   # OTEL_* variables decide, off when they name no endpoint
    lora_modules: {}               # LoRA adapters (PEFT folders) by name, e.g. {sql: /adapters/sql}: a request
                                   # whose model is `sql` is answered with it (engine/lora.py; torch backend)
    lora_loading: {root: null, max_adapters: 16}   # root: adapters in it may be loaded while serving
                                   # (POST /v1/load_lora_adapter, frontdoor/http_lora.py); null: off

Unknown keys are rejected with the list of allowed ones.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, Field, ValidationError, model_validator

from control.worker_tls import WorkerTlsFiles
from engine.lora_files import check_modules
from frontdoor.http_lora import LoraLoading
from frontdoor.schedule_policy import PriorityLevels
from ops.deployment_sections import (FrontDoor, Handoff, Health, Limits, PrefixCacheConfig, Strict, Tracing,
                                     WorkerPool)
from tandem.modes import Mode


class DeploymentError(ValueError):
    """The deployment file or flags are invalid; the message names the field."""


# Chosen from the sweep in docs/benchmarks/prefix-cache (scripts/bench_prefix.py sweep) on a 2-core CPU.
DEFAULT_LOCAL_PREFILL_TOKENS = 0


class Deployment(Strict):
    model: str = "smollm2-135m"
    engines: str | None = None
    # weights and KV of engines built from `model` (explicit `engines` are used as they were built):
    # auto is bfloat16 when a role's workers run on CUDA, float32 (exact against transformers) otherwise;
    # a bf16 checkpoint served in float32 costs twice its size per role copy
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    backend: Literal["torch", "tensorrt-llm"] = "torch"
    mode: Mode = Mode.DISAGGREGATED
    device: Literal["auto", "cpu", "cuda"] = "auto"  # every local worker's, unless its role says otherwise
    prefill: WorkerPool = WorkerPool()
    decode: WorkerPool = WorkerPool()
    replicas: int = Field(1, ge=1, le=64)
    # null: the one-host transport for the decode pool's memory (shm on the CPU, cuda_ipc on a GPU)
    transport: Literal["shm", "cuda_ipc", "nixl", "auto"] | None = None
    router: Literal["least-loaded", "round-robin", "kv-aware"] = "least-loaded"
    local_prefill_tokens: int = Field(DEFAULT_LOCAL_PREFILL_TOKENS, ge=0)
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    kv_pool_bytes: int | None = Field(None, ge=1 << 20)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)  # null: 0.9 on GPUs unless kv_pool_bytes
    chunk_tokens: int = Field(256, ge=1)
    max_num_seqs: int | None = Field(None, ge=1, le=4096)  # vLLM's names; null: the engines' role profiles
    max_num_batched_tokens: int | None = Field(None, ge=16)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"  # priority: requests' `priority` orders the waiting
    priority_levels: int | None = None  # Triton's, with default_priority_level (frontdoor/schedule_policy.py)
    default_priority_level: int | None = None
    max_retries: int = Field(2, ge=0)
    # Local workers run this much nicer (lower CPU priority) than the front door. Where they share cores
    # (CPU-only serving), refusals, health probes and token streaming then wait for no model step; the
    # workers still get every cycle the front door leaves idle, which is nearly all of them.
    worker_nice: int = Field(10, ge=0, le=19)
    front_door: FrontDoor = FrontDoor()
    limits: Limits = Limits()
    health: Health = Health()
    handoff: Handoff = Handoff()
    worker_tls: WorkerTlsFiles | None = None
    tracing: Tracing = Tracing()
    # LoRA adapters a request's `model` may name: folder by name (engine/lora.py)
    lora_modules: Annotated[dict[str, str], AfterValidator(check_modules)] = {}
    lora_loading: LoraLoading = LoraLoading()  # adapters loaded and unloaded while serving

    @property
    def levels(self) -> PriorityLevels:
        """How the KServe doors read a request's priority level (Triton's; frontdoor/schedule_policy.py)."""
        return PriorityLevels(self.priority_levels, self.default_priority_level) if self.priority_levels else \
            PriorityLevels()

    @model_validator(mode="after")
    def _priority_levels(self):
        given = [f for f in ("priority_levels", "default_priority_level") if getattr(self, f) is not None]
        if given and self.scheduling_policy != "priority":
            raise ValueError(f"{' and '.join(given)} set how priority levels read, but scheduling_policy is "
                             f"{self.scheduling_policy}; set scheduling_policy: priority")
        if len(given) == 1:
            raise ValueError(f"give priority_levels and default_priority_level together (as a Triton model's "
                             f"config does), got only {given[0]}")
        if given:
            PriorityLevels(self.priority_levels, self.default_priority_level)  # ValueError: they do not fit
        return self

    @model_validator(mode="after")
    def _workers(self):
        if self.mode is Mode.DISAGGREGATED:
            for role in ("prefill", "decode"):
                pool = getattr(self, role)
                if pool.count + len(pool.urls) < 1 and not pool.dns:
                    raise ValueError(f"disaggregated mode needs at least one {role} worker (count, urls or dns)")
        if self.gpu_memory_utilization is not None and self.kv_pool_bytes is not None:
            raise ValueError("gpu_memory_utilization sizes the KV pools on GPUs from what the weights leave, "
                             "kv_pool_bytes gives them in bytes; give one of the two")
        if self.backend == "tensorrt-llm":
            self._trtllm_combination()
        elif self.handoff.mode == "pull":
            self._pull_transport()
        for role in ("prefill", "decode"):
            pool = getattr(self, role)
            if pool.gpus and (pool.device or self.device) == "cpu":
                raise ValueError(f"{role}.gpus {pool.gpus} given for device cpu; set {role}.device: cuda (or auto)")
        return self

    def _trtllm_combination(self) -> None:
        """backend tensorrt-llm: what its role engines can serve (ValueError naming what is not)."""
        if self.mode != "disaggregated":
            raise ValueError(f"backend tensorrt-llm serves disaggregated mode only (prefill and decode role "
                             f"engines), not mode {self.mode}")
        if self.handoff.mode == "push" and "mode" in self.handoff.model_fields_set:
            raise ValueError("backend tensorrt-llm hands the K/V over by decode pull (TensorRT-LLM's cache "
                             "transceiver); set handoff.mode: pull or leave it out")
        if self.transport is not None:
            raise ValueError(f"backend tensorrt-llm moves the K/V with its own cache transceiver (the role YAMLs' "
                             f"cache_transceiver_config); leave transport out, got {self.transport}")
        if self.local_prefill_tokens:
            raise ValueError("backend tensorrt-llm decode workers do not prefill prompts themselves; "
                             "local_prefill_tokens must be 0")
        if self.max_num_seqs or self.max_num_batched_tokens:
            raise ValueError("backend tensorrt-llm roles take their batch and token limits from their engines' "
                             "YAMLs (tandem build --backend tensorrt-llm); leave max_num_seqs and "
                             "max_num_batched_tokens out")
        if self.scheduling_policy != "fcfs":
            raise ValueError("backend tensorrt-llm roles schedule their requests themselves; leave "
                             "scheduling_policy at fcfs")
        if self.gpu_memory_utilization is not None:
            raise ValueError("backend tensorrt-llm roles size their KV cache themselves (kv_cache_config."
                             "free_gpu_memory_fraction in the role YAMLs); leave gpu_memory_utilization out")
        if self.lora_modules or self.lora_loading.root:
            raise ValueError("backend tensorrt-llm roles run TensorRT-LLM's engines, not Tandem's LoRA adapters; "
                             "leave lora_modules and lora_loading.root out")
        if self.prefix_cache.per_api_key:
            raise ValueError("backend tensorrt-llm roles take no cache salt, so they cannot keep cached prefixes "
                             "apart per API key; leave prefix_cache.per_api_key off")
        for role in ("prefill", "decode"):
            pool = getattr(self, role)
            if pool.count and self.role_device(role) == "cpu":
                raise ValueError(f"backend tensorrt-llm runs on CUDA; {role} has local workers with device cpu "
                                 f"(set device: cuda)")
            if pool.gpus:
                raise ValueError(f"backend tensorrt-llm places its engines on GPUs in order (`tandem repo "
                                 f"--backend tensorrt-llm`); leave {role}.gpus out")

    @property
    def handoff_mode(self) -> str:
        """The serving path's handoff: the deployment's, or TensorRT-LLM's own pull (control/trtllm_attempt.py)."""
        return "trtllm" if self.backend == "tensorrt-llm" else self.handoff.mode

    def _pull_transport(self) -> None:
        """Pull reads from the prefill pool: shm where it is in host memory, cuda_ipc where it is on a GPU
        (into a decode pool on a GPU), NIXL READ anywhere; refuse the combinations that cannot work."""
        prefill, decode, t = self.role_device("prefill"), self.role_device("decode"), self.transport
        if t == "shm" and prefill == "cuda":
            raise ValueError("handoff mode pull with transport shm reads a prefill pool in host memory, but prefill "
                             "workers on cuda keep theirs on the GPU; use transport cuda_ipc, nixl or auto")
        if t == "cuda_ipc" and (prefill == "cpu" or decode == "cpu"):
            raise ValueError("handoff mode pull with transport cuda_ipc reads a prefill pool on a GPU into a decode "
                             "pool on a GPU; set prefill.device and decode.device to cuda (or auto), or use "
                             "transport shm or nixl")
        if t in (None, "auto") and prefill == "cuda" and decode == "cpu":
            raise ValueError("handoff mode pull: prefill workers on cuda are read over cuda_ipc, which needs decode "
                             "workers on cuda too; set decode.device: cuda, or transport nixl")

    def role_device(self, role: str) -> str:
        """The device choice (auto, cpu, cuda) of a role's local workers; `generate` follows `device`."""
        pool = getattr(self, role, None) if role in ("prefill", "decode") else None
        return (pool.device if pool is not None else None) or self.device

    def role_gpus(self, role: str) -> list[int]:
        return list(getattr(self, role).gpus) if role in ("prefill", "decode") else []

    @property
    def engines_dir(self) -> str:
        return self.engines or os.path.join("engines", os.path.basename(os.path.normpath(self.model)).removesuffix(".gguf"))


def load_deployment(path: str | None, overrides: dict) -> Deployment:
    """The file's settings (if any), then the flags given on the command line on top."""
    data: dict = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise DeploymentError(f"cannot read deployment file {path}: {e}") from None
        if not isinstance(data, dict):
            raise DeploymentError(f"{path}: the deployment file must be a mapping")
    for key, value in overrides.items():  # "front_door.tls.cert": nested mappings, made where missing
        *outer, last = key.split(".")
        node = data
        for part in outer:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node[last] = value
    try:
        return Deployment(**data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'file'}: {err['msg']}" for err in e.errors())
        raise DeploymentError(f"invalid deployment: {problems}") from None
