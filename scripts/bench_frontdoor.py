#!/usr/bin/env python3
"""Front-door overhead: the same Triton workers driven through `tandem serve` vs directly, one run.

Starts `tandem serve` (1 prefill + 1 decode worker, default model), then alternates requests:
- through the front door: tritonclient gRPC streaming to the `ensemble` model;
- directly: the same reserve -> prefill -> generate protocol against the worker URLs themselves.
Requests run one at a time (so only overhead differs) and the two paths alternate. It prints TTFT
and per-token latency (mean gap between tokens) medians for both, and the median of the paired
differences (each front-door request minus the direct one right after it).

    python scripts/bench_frontdoor.py [--requests 20] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import numpy as np
import tritonclient.grpc.aio as aio
from tritonclient.grpc import InferInput

from tandem.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from control.fleet import WorkerState
from control.handoff import Handoff, Timings
from ops.serve_process import ServeProcess
from control.worker_client import DecodeClient, PrefillClient

PROMPT = "Describe the water cycle in detail, step by step, for a school report."


def _inputs(prompt: str, max_tokens: int) -> list[InferInput]:
    out = []
    for name, arr, dt in (("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
                          ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
                          ("min_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
                          ("stream", np.array([[True]]), "BOOL")):
        t = InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


async def through(client, prompt: str, n: int, i: int) -> list[float]:
    """Arrival times (seconds since the request was sent) of each streamed response."""
    async def one():
        yield {"model_name": "ensemble", "inputs": _inputs(prompt, n), "request_id": f"fd-{i}"}

    t0 = time.perf_counter()
    times = []
    async for result, error in client.stream_infer(one()):
        if error:
            raise error
        times.append(time.perf_counter() - t0)
        if len(times) == n:
            break
    return times


async def direct(p, d, ids: list[int], n: int, i: int) -> list[float]:
    params = SamplingParams(max_tokens=n, min_tokens=n)
    t0 = time.perf_counter()
    times = []
    async with Handoff(d, p, f"direct-{i}", ids, params, [], Timings()) as h:
        while (tok := await h.next()) is not None:
            if tok.token is not None:
                times.append(time.perf_counter() - t0)
    return times


def summarize(runs: list[list[float]]) -> tuple[float, float]:
    """(median TTFT, median of each request's mean token gap), in ms."""
    ttft = statistics.median(r[0] for r in runs)
    gaps = statistics.median(statistics.mean(np.diff(r)) for r in runs)
    return ttft * 1e3, gaps * 1e3


def paired(via: list[list[float]], direct_runs: list[list[float]]) -> tuple[float, float]:
    """Median over pairs of (front door - direct), for TTFT and for the mean token gap, in ms."""
    d_ttft = statistics.median(a[0] - b[0] for a, b in zip(via, direct_runs))
    d_gap = statistics.median(statistics.mean(np.diff(a)) - statistics.mean(np.diff(b)) for a, b in zip(via, direct_runs))
    return d_ttft * 1e3, d_gap * 1e3


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def measure(grpc_url: str, workers: dict, tokenizer: Tokenizer, requests: int, tokens: int):
    client = aio.InferenceServerClient(grpc_url)
    p = WorkerState("prefill-0", "prefill", workers["prefill-0"]["grpc"], PrefillClient(workers["prefill-0"]["grpc"]))
    d = WorkerState("decode-0", "decode", workers["decode-0"]["grpc"], DecodeClient(workers["decode-0"]["grpc"]))
    p.stats, d.stats = await p.client.stats(), await d.client.stats()
    # keep stats flowing on both channels, as the orchestrator's fleet does: a stream that only pings while
    # the other path runs is closed by the server (GOAWAY "too many pings") on a loaded machine
    watches = [asyncio.create_task(_drain(w.client.watch(1.0, 3.0))) for w in (p, d)]
    ids = tokenizer.encode(PROMPT)
    via, direct_runs = [], []
    for i in range(requests + 2):  # two warm-up rounds
        a = await through(client, PROMPT, tokens, i)
        b = await direct(p, d, ids, tokens, i)
        if i >= 2:
            via.append(a)
            direct_runs.append(b)
    for task in watches:
        task.cancel()
    await client.close()
    await p.client.close()
    await d.client.close()
    return summarize(via), summarize(direct_runs), paired(via, direct_runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--engines", default=None, help="engines folder (default: build/use engines/smollm2-135m)")
    args = ap.parse_args()
    engines = args.engines or os.path.join("engines", "smollm2-135m")
    serve = ServeProcess(tempfile.mkdtemp(prefix="tandem-bench-fd-"),
                         ("--model", args.engines or "smollm2-135m", "--kv-pool-bytes", str(256 << 20))).start()
    try:
        tok = Tokenizer(os.path.join(engines, "prefill"))
        (t_via, g_via), (t_dir, g_dir), (dt, dg) = asyncio.run(measure(serve.grpc, serve.workers(), tok, args.requests,
                                                                          args.tokens))
    finally:
        serve.stop()
    print(f"{args.requests} sequential requests x {args.tokens} tokens, prompt of {len(tok.encode(PROMPT))} tokens")
    print(f"{'path':>22} {'TTFT p50 ms':>12} {'per-token p50 ms':>17}")
    print(f"{'direct to workers':>22} {t_dir:>12.2f} {g_dir:>17.3f}")
    print(f"{'through front door':>22} {t_via:>12.2f} {g_via:>17.3f}")
    print(f"{'added (paired median)':>22} {dt:>+12.2f} {dg:>+17.3f}   (targets: <= 5 ms, <= 0.5 ms)")


if __name__ == "__main__":
    main()
