"""The multi-turn workload: conversations that grow turn by turn behind one shared system prompt.

Each of `conversations` users talks for `turns` turns. Turn k's prompt is the system prompt, every
earlier user message and answer, and the new user message:

    <system>\nUser: <u1>\nAssistant: <a1>\nUser: <u2>\nAssistant:

so a prefix cache can serve everything but the newest message (and a router that sends a conversation
back to where its pages are cached makes that likely). Turns go in rounds: every conversation sends
turn k at once, and round k+1 starts when all answers of round k are in; between rounds the front
door's Prometheus metrics are read, so KV bytes moved and cache hits are known per turn. Answers are
exactly `answer_tokens` long (min_tokens = max_tokens), so every mode does the same work.

Prompts are seeded random words (clients/bench/bench_workload.make_prompt): the same seed gives the
same conversations in every mode. Either front door: the Triton gRPC ensemble or OpenAI completions.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np
import tritonclient.grpc.aio as grpc_aio
from tritonclient.grpc import InferInput, InferRequestedOutput

from clients.bench.bench_workload import make_prompt
from clients.sse_reader import sse_chunks


@dataclass(frozen=True)
class MultiTurn:
    conversations: int = 8
    turns: int = 6
    system_tokens: int = 512
    user_tokens: int = 64
    answer_tokens: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("conversations", "turns", "system_tokens", "user_tokens", "answer_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Turn:
    conversation: int
    turn: int  # 1-based
    response_times: list[float] = field(default_factory=list)  # seconds after it was sent, one per response
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # OpenAI usage reports it; the gRPC ensemble does not
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.response_times)


def user_messages(spec: MultiTurn, tokenizer) -> tuple[str, list[list[str]]]:
    """The shared system prompt and each conversation's user messages."""
    rng = random.Random(spec.seed)
    system = make_prompt(tokenizer, spec.system_tokens, rng)
    return system, [[make_prompt(tokenizer, spec.user_tokens, rng) for _ in range(spec.turns)]
                    for _ in range(spec.conversations)]


class GrpcTurns:
    """Turns through the Triton gRPC ensemble (streaming), as tritonclient sends them."""

    def __init__(self, url: str, model: str = "ensemble"):
        self.client, self.model = grpc_aio.InferenceServerClient(url.removeprefix("grpc://")), model

    async def send(self, rec: Turn, prompt: str, max_tokens: int) -> None:
        inputs = []
        for name, arr, dt in (("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
                              ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
                              ("min_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
                              ("stream", np.array([[True]]), "BOOL")):
            inputs.append(InferInput(name, list(arr.shape), dt))
            inputs[-1].set_data_from_numpy(arr)
        outputs = [InferRequestedOutput(n) for n in ("text_output", "num_input_tokens")]

        async def one():
            yield {"model_name": self.model, "inputs": inputs, "outputs": outputs,
                   "request_id": f"c{rec.conversation}-t{rec.turn}", "enable_empty_final_response": True}

        t0, pieces = time.perf_counter(), []
        async for result, error in self.client.stream_infer(one()):
            if error is not None:
                rec.error = str(error)
                return
            text = result.as_numpy("text_output")
            if text is not None and text.reshape(-1)[0]:
                rec.response_times.append(time.perf_counter() - t0)
                pieces.append(text.reshape(-1)[0].decode())
                rec.prompt_tokens = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        rec.text = "".join(pieces)

    async def close(self) -> None:
        await self.client.close()


class OpenAITurns:
    """Turns through OpenAI /v1/completions with SSE streaming; usage says how many tokens were cached."""

    def __init__(self, url: str, model: str = "ensemble"):
        self.url, self.model = url.rstrip("/"), model
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))

    async def send(self, rec: Turn, prompt: str, max_tokens: int) -> None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        t0, pieces = time.perf_counter(), []
        async with self.session.post(f"{self.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for chunk in sse_chunks(resp):
                if "error" in chunk:
                    rec.error = chunk["error"]["message"]
                elif chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    rec.response_times.append(time.perf_counter() - t0)
                    pieces.append(chunk["choices"][0]["text"])
        rec.text = "".join(pieces)

    async def close(self) -> None:
        await self.session.close()


def make_turns_client(protocol: str, url: str, model: str = "ensemble"):
    if protocol == "grpc":
        return GrpcTurns(url, model)
    if protocol == "openai":
        return OpenAITurns(url if url.startswith("http") else f"http://{url}", model)
    raise ValueError(f"unknown protocol {protocol!r}; allowed: grpc, openai")


# Running totals read from the front door between rounds: what each round cost, by difference.
COUNTERS = {"kv_bytes": "tandem_kv_transfer_bytes_total", "hit_pages": "tandem_prefix_cache_hit_pages_total",
            "miss_pages": "tandem_prefix_cache_miss_pages_total", "local_prefills": "tandem_local_prefills_total"}


def read_counters(metrics_url: str, counters: dict[str, str] = COUNTERS) -> dict[str, float]:
    """Each of `counters`' totals (key -> metric name), summed over its label sets (workers, transports)."""
    with urllib.request.urlopen(metrics_url.rstrip("/") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for key, name in counters.items():
        out[key] = sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M))
    return out


async def run_multiturn(spec: MultiTurn, client, tokenizer, metrics_url: str | None = None) -> dict:
    """Every round of every conversation; returns {"turns": [Turn...], "rounds": [counter deltas...]}."""
    system, users = user_messages(spec, tokenizer)
    history = [system for _ in range(spec.conversations)]
    turns: list[Turn] = []
    rounds: list[dict] = []
    loop = asyncio.get_running_loop()
    before = await loop.run_in_executor(None, read_counters, metrics_url) if metrics_url else None
    for k in range(spec.turns):
        recs = [Turn(c, k + 1) for c in range(spec.conversations)]
        prompts = [f"{history[c]}\nUser: {users[c][k]}\nAssistant:" for c in range(spec.conversations)]
        t0 = time.perf_counter()
        await asyncio.gather(*(_send(client, r, p, spec.answer_tokens) for r, p in zip(recs, prompts)))
        wall = time.perf_counter() - t0
        for c, r in enumerate(recs):
            history[c] = prompts[c] + r.text  # exactly what was generated: the next prompt extends this one
        turns += recs
        row = {"turn": k + 1, "wall_s": wall}
        if metrics_url:
            after = await loop.run_in_executor(None, read_counters, metrics_url)
            row.update({key: after[key] - before[key] for key in COUNTERS})
            before = after
        rounds.append(row)
    return {"turns": turns, "rounds": rounds}


async def _send(client, rec: Turn, prompt: str, max_tokens: int) -> None:
    try:
        await client.send(rec, prompt, max_tokens)
    except Exception as e:  # a transport failure is this turn's error; the conversation goes on
        rec.error = f"{type(e).__name__}: {e}"
