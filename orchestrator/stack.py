"""A whole deployment in one process: role workers (Triton instances), the orchestrator service, and
both front doors. `tandem serve` runs one; tests and benchmarks start and stop it the same way."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile

from builder.build import BuildError, BuildRequest, build
from builder.repo import RepoOptions
from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from orchestrator.deployment import Deployment, DeploymentError
from orchestrator.grpc_frontend import TritonProtocolServicer, start_grpc
from orchestrator.http_frontend import HttpFrontend, start_http
from orchestrator.metrics import Metrics
from orchestrator.router import ROUTERS
from orchestrator.service import Orchestrator
from orchestrator.workers import WorkerSet
from tandem.manifest import ManifestError, check_pair, read_manifest


def ensure_engines(dep: Deployment, log=print) -> str:
    """The deployment's engines folder. Engines named explicitly are used as they are (built elsewhere,
    perhaps); engines derived from `model` are (re)built when missing or stale (a no-op otherwise)."""
    folder = dep.engines_dir
    have = all(os.path.isfile(os.path.join(folder, r, "manifest.json")) for r in ("prefill", "decode"))
    if not (have and dep.engines):
        try:
            build(BuildRequest(model=dep.model, out=folder), log=log)
        except BuildError as e:
            raise DeploymentError(str(e)) from None
    try:
        check_pair(read_manifest(os.path.join(folder, "prefill")), read_manifest(os.path.join(folder, "decode")))
    except ManifestError as e:
        raise DeploymentError(str(e)) from None
    return folder


class Stack:
    def __init__(self, dep: Deployment, workdir: str | None = None, log=print):
        self.dep = dep
        self.workdir = workdir or tempfile.mkdtemp(prefix="tandem-serve-")
        self.log = log
        self.workers: WorkerSet | None = None
        self.service: Orchestrator | None = None
        self.grpc = self.http = None

    async def start(self) -> None:
        dep = self.dep
        loop = asyncio.get_running_loop()
        engines = await loop.run_in_executor(None, ensure_engines, dep, self.log)
        manifest = read_manifest(os.path.join(engines, "decode"))
        counts = ({"prefill": dep.prefill.count, "decode": dep.decode.count} if dep.mode == "disaggregated"
                  else {"generate": 1})
        options = RepoOptions(transport=dep.transport, kv_pool_bytes=dep.kv_pool_bytes,
                              chunk_tokens=dep.chunk_tokens if dep.mode == "chunked" else 0)
        self.workers = WorkerSet(engines, self.workdir, counts, options)
        self.log(f"starting {', '.join(f'{n} {r}' for r, n in counts.items() if n)} worker(s) ({dep.mode}) ...")
        await loop.run_in_executor(None, self.workers.start)
        self._record_workers()
        tokenizer = Tokenizer(os.path.join(engines, "prefill"))
        self.service = Orchestrator(
            mode=dep.mode, tokenizer=tokenizer, max_context=_max_context(engines), router=ROUTERS[dep.router](),
            metrics=Metrics(dep.mode), tokens_per_page=manifest.kv_layout.tokens_per_page,
            prefill_urls=self.workers.urls("prefill") + list(dep.prefill.urls if dep.mode == "disaggregated" else []),
            decode_urls=self.workers.urls("decode") + list(dep.decode.urls if dep.mode == "disaggregated" else []),
            generate_urls=self.workers.urls("generate"), max_retries=dep.max_retries)
        await self.service.start()
        servicer = TritonProtocolServicer(self.service, dep.front_door.model_name)
        fd = dep.front_door
        self.grpc = await start_grpc(servicer, fd.host, fd.grpc_port)
        self.http = await start_http(HttpFrontend(servicer), fd.host, fd.http_port)

    def _record_workers(self) -> None:
        """workdir/workers.json: each worker's pid, URL and cores (for operators, and failure tests)."""
        state = {name: {"pid": s.proc.pid, "grpc": s.grpc_url, "cpus": list(s.cpus or ()), "log": s.log_path}
                 for name, s in self.workers.servers.items()}
        with open(os.path.join(self.workdir, "workers.json"), "w") as f:
            json.dump(state, f, indent=2)

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.cleanup()
        if self.grpc is not None:
            await self.grpc.stop(grace=2)
        if self.service is not None:
            await self.service.stop()
        if self.workers is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.workers.stop)


def _max_context(engines: str) -> int:
    with open(os.path.join(engines, "prefill", "config.json"), encoding="utf-8") as f:
        return ModelConfig.from_hf(json.load(f)).max_position
