"""Clients that send one benchmark request through a front door and time every response.

- grpc: tritonclient's asyncio gRPC streaming to the `ensemble` model (what genai-perf does);
- openai: /v1/completions with SSE streaming.
Both ask for exactly `max_tokens` tokens (min_tokens = max_tokens), so lengths do not depend on EOS. A
request naming a model (a LoRA adapter: RequestSpec.model) sends it as `lora_name` over gRPC and as
`model` over OpenAI.
"""

from __future__ import annotations

import time

import aiohttp
import numpy as np
import tritonclient.grpc.aio as grpc_aio
from tritonclient.grpc import InferInput, InferRequestedOutput

from clients.bench.stats import RequestRecord
from clients.bench.bench_workload import RequestSpec
from clients.sse_reader import sse_chunks
from frontdoor.schedule_policy import PriorityLevels


class GrpcDriver:
    def __init__(self, url: str, model: str = "ensemble"):
        self.client = grpc_aio.InferenceServerClient(url)
        self.model = model
        self._levels: PriorityLevels | None = None  # the model's, read from its config when first needed

    async def level(self, priority: int) -> int:
        """Triton's level for a request's priority (0: the model's default): on the levels the model's config
        advertises (frontdoor/schedule_policy.py), or Tandem's default levels where it advertises none (the
        server then refuses a non-zero priority, as it should)."""
        if not priority:
            return 0
        if self._levels is None:
            given = (await self.client.get_model_config(self.model)).config.dynamic_batching
            self._levels = PriorityLevels(given.priority_levels, given.default_priority_level) \
                if given.priority_levels else PriorityLevels()
        return self._levels.level(priority)

    def _inputs(self, spec: RequestSpec) -> list[InferInput]:
        out = []
        adapter = (("lora_name", np.array([[spec.model.encode()]], dtype=np.object_), "BYTES"),) if spec.model else ()
        for name, arr, dt in (("text_input", np.array([[spec.prompt.encode()]], dtype=np.object_), "BYTES"),
                              ("max_tokens", np.array([[spec.max_tokens]], dtype=np.int32), "INT32"),
                              ("min_tokens", np.array([[spec.max_tokens]], dtype=np.int32), "INT32"),
                              ("stream", np.array([[True]]), "BOOL"), *adapter):
            t = InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            out.append(t)
        return out

    async def send(self, spec: RequestSpec, t_run: float) -> RequestRecord:
        rec = RequestRecord(spec.stream, time.perf_counter() - t_run, warmup=spec.warmup)
        outputs = [InferRequestedOutput(n) for n in ("text_output", "num_output_tokens", "num_input_tokens")]

        async def one(level: int):
            yield {"model_name": self.model, "inputs": self._inputs(spec), "outputs": outputs,
                   "request_id": f"{spec.stream}-{spec.index}", "enable_empty_final_response": True,
                   "priority": level}

        try:
            level = await self.level(spec.priority)  # before the clock starts: read once per driver
            t0 = time.perf_counter()
            async for result, error in self.client.stream_infer(one(level)):
                if error is not None:
                    rec.error = str(error)
                    break
                now = time.perf_counter() - t0
                text = result.as_numpy("text_output")
                if text is not None and text.reshape(-1)[0]:
                    rec.response_times.append(now)
                    rec.output_tokens = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                    rec.prompt_tokens = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        except Exception as e:  # a transport failure is recorded as this request's error
            rec.error = f"{type(e).__name__}: {e}"
        return rec

    async def close(self) -> None:
        await self.client.close()


class OpenAIDriver:
    def __init__(self, url: str, model: str = "ensemble"):
        self.url = url.rstrip("/")
        self.model = model
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))

    async def send(self, spec: RequestSpec, t_run: float) -> RequestRecord:
        rec = RequestRecord(spec.stream, time.perf_counter() - t_run, warmup=spec.warmup)
        body = {"model": spec.model or self.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
                "min_tokens": spec.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **({"priority": spec.priority} if spec.priority else {})}
        t0 = time.perf_counter()
        try:
            async with self.session.post(f"{self.url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return rec
                async for chunk in sse_chunks(resp):
                    if "error" in chunk:
                        rec.error = chunk["error"]["message"]
                    elif chunk.get("usage"):
                        rec.output_tokens = chunk["usage"]["completion_tokens"]
                        rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    elif chunk["choices"] and chunk["choices"][0]["text"]:
                        rec.response_times.append(time.perf_counter() - t0)
        except (aiohttp.ClientError, TimeoutError) as e:
            rec.error = f"{type(e).__name__}: {e}"
        return rec

    async def close(self) -> None:
        await self.session.close()


def make_driver(protocol: str, url: str, model: str = "ensemble"):
    if protocol == "grpc":
        return GrpcDriver(url.removeprefix("grpc://"), model)
    if protocol == "openai":
        return OpenAIDriver(url if url.startswith("http") else f"http://{url}", model)
    raise ValueError(f"unknown protocol {protocol!r}; allowed: grpc, openai")
