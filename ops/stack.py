"""A whole deployment in one process: role workers (Triton instances), the orchestrator service, and
both front doors. `tandem serve` runs one; tests and benchmarks start and stop it the same way.

The serving path (disaggregated, or co-located replicas) is chosen here, once, from the deployment's
mode; nothing after this point asks which mode it is in. So is the role engines' backend: Tandem's own,
or TensorRT-LLM's (ops/trtllm_stack.py; its worker clients, and the serving path's trtllm handoff).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time

from builder.build import BuildError, BuildRequest, build
from builder.repo import RepoOptions
from engine.shm_region import remove_orphaned_triton_regions, remove_stale_segments
from control.adapters import Adapters
from control.admission import Admission
from ops.deployment import Deployment, DeploymentError
from ops.model_files import read_model_files, served_names
from ops.door_security import DoorSecurity, check_ports_free, check_secret_links, door_security, reload_doors
from control.discovery import Discovery
from control.fleet import Fleet
from control.worker_client import CLIENTS, TRTLLM_CLIENTS
from frontdoor.grpc_door import TritonProtocolServicer, start_grpc
from frontdoor.http_app import HttpFrontend, start_http
from frontdoor.http_lora import LoraRoutes
from frontdoor.response_store import ResponseStore
from frontdoor.door_metrics import Metrics
from control.serving_path import make_path
from control.requests import Limits
from control.router import ROUTERS
from frontdoor.core import FrontDoor, ServedModel
from control.orchestrator import Orchestrator
from ops.supervisor import Supervisor
from ops.gpu_plan import gpu_totals, role_gpus, sized_pools
from tandem.devices import DeviceError, resolve_device
from ops.local_workers import WorkerSet
from ops.trtllm_stack import trtllm_engines, trtllm_gpus_per_node
from tandem.manifest import EngineManifest, ManifestError, check_pair, read_manifest
from tandem.modes import Mode
from tandem.roles import Role
from tandem.secret import PARAMETER as SECRET_PARAMETER
from tandem.secret import SecretError, load_secret
from tandem.tracing import TraceConfig, TraceConfigError, Tracer, make_tracer

log = logging.getLogger("tandem.serve")


def engine_dtype(dep: Deployment) -> str:
    """The dtype to build `dep.model` in: its own, or for `auto` bfloat16 when any role's local workers
    run on CUDA (memory-bound decode reads half the bytes) and float32 otherwise (exact on CPU)."""
    if dep.dtype != "auto":
        return dep.dtype
    on_cuda = any(resolve_device(dep.role_device(r)) == "cuda" for r in ("prefill", "decode"))
    return "bfloat16" if on_cuda else "float32"


def ensure_engines(dep: Deployment, log=print) -> str:
    """The deployment's engines folder. Engines named explicitly are used as they are (built elsewhere,
    perhaps); engines derived from `model` are (re)built when missing or stale (a no-op otherwise)."""
    folder = dep.engines_dir
    have = all(os.path.isfile(os.path.join(folder, r, "manifest.json")) for r in ("prefill", "decode"))
    if not (have and dep.engines):
        try:
            build(BuildRequest(model=dep.model, out=folder, dtype=engine_dtype(dep)), log=log)
        except BuildError as e:
            raise DeploymentError(str(e)) from None
    try:
        check_pair(read_manifest(os.path.join(folder, "prefill")), read_manifest(os.path.join(folder, "decode")))
    except ManifestError as e:
        raise DeploymentError(str(e)) from None
    return folder


def worker_counts(dep: Deployment) -> dict[Role, int]:
    if dep.mode is Mode.DISAGGREGATED:
        return {Role.PREFILL: dep.prefill.count, Role.DECODE: dep.decode.count}
    return {Role.GENERATE: dep.replicas}


def local_gpus(dep: Deployment) -> dict[str, tuple[int, ...]]:
    """The GPUs of the deployment's local CUDA workers (ops/gpu_plan.py); DeploymentError naming CUDA when
    the deployment asks for CUDA and this machine has none, or sizes pools to GPU memory with none on one."""
    try:
        gpus = role_gpus(dep, worker_counts(dep))
    except DeviceError as e:
        raise DeploymentError(str(e)) from None
    if not gpus and dep.gpu_memory_utilization is not None:
        raise DeploymentError("gpu_memory_utilization sizes KV pools on GPUs, but no local worker runs on one; "
                              "size pools on the CPU with kv_pool_bytes (--kv-pool-bytes)")
    return gpus


def trace_config(dep: Deployment) -> TraceConfig | None:
    """Where spans go: the deployment's OTLP endpoint, else the OTEL_* variables; None: tracing off."""
    try:
        return TraceConfig.from_env(os.environ, dep.tracing.otlp_endpoint)
    except TraceConfigError as e:
        raise DeploymentError(str(e)) from None


class Stack:
    def __init__(self, dep: Deployment, workdir: str | None = None, log=print, tracer: Tracer | None = None):
        """`tracer`: the orchestrator's (a test's in-memory one); None: the one the deployment configures.
        Either way the local workers export to the deployment's configuration."""
        self.dep = dep
        self.tracer, self._own_tracer = tracer, tracer is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="tandem-serve-")
        os.makedirs(self.workdir, exist_ok=True)
        self.log = log
        self.workers: WorkerSet | None = None
        self.fleet: Fleet | None = None
        self.adapters: Adapters | None = None
        self.supervisor: Supervisor | None = None
        self.discovery: Discovery | None = None
        self.service: Orchestrator | None = None
        self.grpc = self.http = None
        self.security: DoorSecurity | None = None

    async def start(self) -> None:
        dep = self.dep
        loop = asyncio.get_running_loop()
        check_ports_free(dep)  # every check that can fail the start, before anything slow
        gpus = local_gpus(dep)  # CUDA asked for and absent is refused at once
        self.security = security = door_security(dep)
        try:
            secret = load_secret()
        except SecretError as e:
            raise DeploymentError(str(e)) from None
        check_secret_links(dep, secret, security.worker_tls)
        traced = trace_config(dep)
        if self.tracer is None:
            try:
                self.tracer = make_tracer(traced)
            except TraceConfigError as e:  # the otel extra is missing
                raise DeploymentError(str(e)) from None
        trtllm = dep.backend == "tensorrt-llm"
        if trtllm:  # TensorRT-LLM role engines: no Tandem manifest; they place themselves on the GPUs
            built = await loop.run_in_executor(None, trtllm_engines, dep, self.log)
            engines, tokens_per_page, names = built.folder, built.tokens_per_page, built.served_names
            per_node, gpus = trtllm_gpus_per_node(dep, gpus, built), {}
        else:
            engines = await loop.run_in_executor(None, ensure_engines, dep, self.log)
            manifest = read_manifest(os.path.join(engines, "decode"))
            tokens_per_page, names, per_node = manifest.kv_layout.tokens_per_page, served_names(dep, manifest.source), 0
        model = read_model_files(engines, dep, self.log)  # before any worker starts: one line if it cannot be read
        counts = worker_counts(dep)
        pools = self._gpu_pools(engines, gpus, counts)
        options = RepoOptions(transport=dep.transport,
                              kv_pool_bytes=pools.get(Role.DECODE, pools.get(Role.GENERATE, dep.kv_pool_bytes)),
                              chunk_tokens=dep.chunk_tokens if dep.mode is Mode.CHUNKED else 0,
                              transfer_timeout_s=dep.handoff.transfer_timeout_s,
                              fence_timeout_s=dep.handoff.fence_timeout_s, prefix_cache=dep.prefix_cache.enabled,
                              prefill_pool_bytes=pools.get(Role.PREFILL, dep.prefix_cache.prefill_pool_bytes),
                              handoff=dep.handoff.mode,
                              lora_modules=tuple(dep.lora_modules.items()), max_num_seqs=dep.max_num_seqs,
                              max_num_batched_tokens=dep.max_num_batched_tokens)
        for name in remove_stale_segments() + remove_orphaned_triton_regions():
            self.log(f"removed shared memory {name} left by a process that is gone")
        self.workers = WorkerSet(engines, self.workdir, counts, options, gpus=gpus, nice=dep.worker_nice,
                                 tls=security.local_worker_tls, backend=dep.backend, gpus_per_node=per_node,
                                 env=traced.worker_env() if traced else {},
                                 avoid_ports=(dep.front_door.grpc_port, dep.front_door.http_port))
        if any(counts.values()):  # none: every worker is remote (`tandem worker` elsewhere)
            self.log(f"starting {', '.join(f'{n} {r}' for r, n in counts.items() if n)} worker(s) ({dep.mode}) ...")
            await loop.run_in_executor(None, self.workers.prepare)
            for name in self.workers.specs:
                self.workers.launch(name)  # on the loop's thread: workers are tied to the thread that starts them
            await asyncio.gather(*[loop.run_in_executor(None, self.workers.wait_ready, name)
                                   for name in self.workers.specs])
        self._record_workers()
        metrics = Metrics(dep.mode, tokens_per_page, names[0])
        auth = ((SECRET_PARAMETER, secret),) if secret else ()
        self.fleet = Fleet(dep.health.heartbeat_s, dep.health.stall_s, auth=auth, tls=security.worker_tls,
                           clients=TRTLLM_CLIENTS if trtllm else CLIENTS, tokens_per_call=dep.handoff.tokens_per_call)
        metrics.workers.watch(self.fleet)
        self.adapters = adapters = Adapters(dep.lora_modules, dep.lora_loading.max_adapters)
        adapters.attach(self.fleet)  # a joining worker gets the adapters loaded while serving
        if not trtllm:  # TensorRT-LLM's roles serve no adapters
            metrics.vllm.watch_adapters(adapters)
        self.supervisor = Supervisor(self.workers, self.fleet, dep.health.stall_restart_s,
                                     on_restart=lambda name, server: self._record_workers())
        self.fleet.on_change = self.supervisor.on_health
        for name, s in sorted(self.workers.servers.items()):
            self.fleet.add(name, self.workers.specs[name].role, s.grpc_url)
        self.discovery = Discovery(self.fleet)
        await self.discovery.start(dep)
        self.supervisor.start()
        path = make_path(dep.mode, self.fleet, ROUTERS[dep.router](), tokens_per_page, metrics, dep.max_retries,
                         dep.local_prefill_tokens, dep.handoff_mode, adapters)
        lim = dep.limits
        tokenizer, cfg = model.tokenizer, model.config
        self.service = Orchestrator(path=path, tokenizer=tokenizer, metrics=metrics, mode=dep.mode,
                                    limits=Limits(model.context, cfg.vocab_size, lim.max_prompt_chars,
                                                  tuple(sorted(tokenizer.end_ids(cfg.eos_token_ids))), adapters,
                                                  priority_scheduling=dep.scheduling_policy == "priority"),
                                    admission=Admission(lim.max_in_flight, lim.max_queued_tokens,
                                                        max_in_flight_per_key=lim.max_in_flight_per_key),
                                    timeout_s=lim.request_timeout_s, tracer=self.tracer)
        if self.workers.servers:  # remote-only: /health says 503 until the workers answer, the front door is up
            await self._until_ready()
        fd = dep.front_door
        served = ServedModel(self.service, fd.model_name, names[0], fd.tool_call_parser, fd.reasoning_parser,
                             model.sampling_defaults, aliases=tuple(names[1:]), adapters=adapters, levels=dep.levels)
        door = FrontDoor(served)
        try:
            self.grpc = await start_grpc(TritonProtocolServicer(door, lim.send_timeout_s), fd.host, fd.grpc_port,
                                         security.grpc_credentials, security.keys, fd.grpc_max_connection_age_s)
            kept = ResponseStore(fd.responses_kept, fd.responses_kept_bytes)
            lora = None if trtllm else LoraRoutes(adapters, dep.lora_loading.root, cfg, (*names, fd.model_name))
            self.http = await start_http(HttpFrontend(door, lim.max_body_bytes, security.keys, kept, fd.cors, lora),
                                         fd.host, fd.http_port, security.ssl_context, lim.receive_timeout_s,
                                         lim.send_timeout_s)
        except OSError as e:  # taken since the check at the start
            raise DeploymentError(e.strerror or str(e)) from None
        self.served = served

    def _gpu_pools(self, engines: str, gpus: dict, counts: dict) -> dict[Role, int]:
        """The KV pool bytes of the local CUDA roles when sized to GPU memory (ops/gpu_plan.py), else {};
        DeploymentError when the workers do not fit their GPUs."""
        if not gpus:
            return {}
        try:
            pools = sized_pools(self.dep, engines, gpus, counts, gpu_totals(gpus))
        except DeviceError as e:
            raise DeploymentError(str(e)) from None
        if pools:
            self.log("KV pools sized to GPU memory: " + ", ".join(f"{r} {b / 2**30:.2f} GiB per worker"
                                                                  for r, b in sorted(pools.items()) if r in gpus))
        return pools

    async def reload(self, dep: Deployment) -> str:
        """A new deployment file: read the API keys and TLS files again and follow its remote workers
        (everything else needs a restart); returns what it did, in words. Keys or files that cannot be
        taken raise DeploymentError before anything changes."""
        said = reload_doors(self.security, dep)
        await self.discovery.apply(dep)
        self.dep = dep
        return f"{said}; the worker list followed"

    async def _until_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until every role has a routable worker (their watches connected)."""
        deadline = time.monotonic() + timeout_s
        while not self.service.path.ready():
            if not await self.fleet.wait_change(self.fleet.version, deadline):
                why = " | ".join(self.fleet.why_not_ready(self.service.path.roles))
                raise DeploymentError(f"workers did not become ready within {timeout_s:.0f}s: {why}")

    def _record_workers(self) -> None:
        """workdir/workers.json: each worker's role, pid, gRPC URL, Triton metrics address (host:port, scraped
        at /metrics), cores and log (for operators, scrapers and failure tests)."""
        state = {name: {"role": self.workers.specs[name].role, "pid": s.proc.pid, "grpc": s.grpc_url,
                        "metrics": f"{s.local_host}:{s.metrics_port}",
                        "cpus": list(s.cpus or ()), "log": s.log_path}
                 for name, s in self.workers.servers.items()}
        path = os.path.join(self.workdir, "workers.json")
        with open(path + ".tmp", "w") as f:
            json.dump(state, f, indent=2)
        os.replace(path + ".tmp", path)  # a reader (a chaos run, a scraper) never sees half a file

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests (readiness false on both doors at once) and let the ones in flight
        finish, for at most `grace_s`."""
        if self.service is None:
            return
        self.service.draining = True
        deadline = time.monotonic() + grace_s
        while self.service.admission.in_flight and time.monotonic() < deadline:
            await self.fleet.wait_change(self.fleet.version, min(deadline, time.monotonic() + 0.5))

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()
        if self.supervisor is not None:
            await self.supervisor.close()
        if self.service is not None:
            self.service.draining = True
        if self.http is not None:
            await self.http.cleanup()
        if self.grpc is not None:
            await self.grpc.stop(grace=2)
        if self.adapters is not None:  # workers shared with other replicas keep only what those need
            await self.adapters.release()
        if self.fleet is not None:
            await self.fleet.close()
        if self.service is not None:
            self.service.close()
        if self.workers is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.workers.stop)
        if self.tracer is not None and self._own_tracer:  # what is still buffered goes out (a blocking export)
            await asyncio.get_running_loop().run_in_executor(None, self.tracer.close)
