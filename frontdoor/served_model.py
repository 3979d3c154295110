"""The one LLM model both front doors serve: its names, its Triton config and metadata, its statistics,
and collecting a whole (non-streamed) answer. Both front doors use this, never each other.

Names: gRPC and KServe HTTP serve it as `triton_name` (`ensemble` by default, TensorRT-LLM's name, so
existing Triton clients work unchanged); the OpenAI API serves it as `served_name` (the model's own
name, e.g. `smollm2-135m`, as vLLM's --served-model-name) and accepts the Triton name as an alias.
"""

from __future__ import annotations

import contextlib
import time

from tritonclient.grpc import model_config_pb2 as mc

from frontdoor.model_contract import INPUTS, MAX_BATCH_SIZE, OUTPUTS
from frontdoor.requests import Prepared
from control.orchestrator import Orchestrator

_TYPE = {"BYTES": mc.TYPE_STRING, "INT32": mc.TYPE_INT32, "UINT64": mc.TYPE_UINT64, "FP32": mc.TYPE_FP32,
         "BOOL": mc.TYPE_BOOL}


def model_config(name: str) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=MAX_BATCH_SIZE)
    cfg.model_transaction_policy.decoupled = True
    for t in INPUTS:
        cfg.input.add(name=t.name, data_type=_TYPE[t.datatype], dims=list(t.dims), optional=t.optional)
    for t in OUTPUTS:
        cfg.output.add(name=t.name, data_type=_TYPE[t.datatype], dims=list(t.dims))
    return cfg


class Stats:
    """Per-model counters for ModelStatistics (perf_analyzer reads them)."""

    def __init__(self):
        self.success = self.fail = self.success_ns = self.fail_ns = 0
        self.last_ms = 0

    def record(self, ok: bool, start: float) -> None:
        ns = int((time.perf_counter() - start) * 1e9)
        if ok:
            self.success, self.success_ns = self.success + 1, self.success_ns + ns
        else:
            self.fail, self.fail_ns = self.fail + 1, self.fail_ns + ns
        self.last_ms = int(time.time() * 1000)

    def to_json(self, name: str) -> dict:
        """Triton's statistics extension over HTTP (GET /v2/models/{m}/stats): one model, version 1.
        Only whole requests are timed here, so queue and compute durations are not reported."""
        duration = lambda count, ns: {"count": count, "ns": ns}  # noqa: E731
        return {"model_stats": [{
            "name": name, "version": "1", "last_inference": self.last_ms, "inference_count": self.success,
            "execution_count": self.success, "batch_stats": [], "memory_usage": [],
            "inference_stats": {"success": duration(self.success, self.success_ns),
                                "fail": duration(self.fail, self.fail_ns)}}]}


class ServedModel:
    def __init__(self, service: Orchestrator, triton_name: str = "ensemble", served_name: str | None = None):
        self.service = service
        self.triton_name = triton_name
        self.served_name = served_name or triton_name
        self.config = model_config(triton_name)
        self.stats = Stats()

    def known_triton(self, name: str, version: str = "") -> bool:
        return name == self.triton_name and version in ("", "1")

    def known_openai(self, name: str | None) -> bool:
        return name is None or name in (self.served_name, self.triton_name)

    def metadata(self) -> dict:
        meta = lambda ts: [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.dims]} for t in ts]  # noqa: E731
        return {"name": self.triton_name, "versions": ["1"], "platform": "python", "inputs": meta(INPUTS),
                "outputs": meta(OUTPUTS)}

    async def collect(self, prep: Prepared) -> tuple[str, list[float], int, str | None]:
        """The whole answer: (text, logprobs, tokens, finish reason)."""
        text, logprobs, n, reason = [], [], 0, None
        async with contextlib.aclosing(self.service.stream(prep)) as deltas:  # a cancel cleans up at once
            async for d in deltas:
                text.append(d.text)
                if d.token is not None:
                    n += 1
                    if d.logprob is not None:
                        logprobs.append(d.logprob)
                reason = d.finish_reason or reason
        return "".join(text), logprobs, n, reason
