"""A 1P1D deployment on the one device through the Triton-free worker runtime (engine/workers): a
prefill worker and a decode worker, each with its own engine on the device, the KV pages handed
over by the inproc transport (device-to-device copies into the decode pool). The streamed greedy
answer must equal the single engine's; TTFT and ITL are measured at the workers' reply sinks.

Runtime, said plainly in the report: both workers in this one process (no Triton server on the
device machine; two processes need the cuda_ipc transport, measured on its own in ipc_check).
"""

from __future__ import annotations

import statistics
import threading
import time

from engine.engine import Engine
from engine.kv_pool import KVCache
from engine.transports.host import PoolHost
from engine.workers.decode_worker import DecodeWorker
from engine.workers.prefill_worker import PrefillWorker
from tandem.pool import host_identity
from tandem.sampling_params import SamplingParams
from tandem.wire import Open, Prefill, Prefilled, Reserved, Start, Token

RUNTIME = "engine/workers (prefill + decode worker threads in one process, inproc transport on the device)"


class _TimedSink:
    """Records each reply with its arrival time."""

    def __init__(self):
        self.replies: list[tuple[float, object]] = []
        self.error = None
        self.done = False
        self.finished = threading.Event()

    def send(self, body, final=False):
        self.replies.append((time.perf_counter(), body))
        if final:
            self.done = True
            self.finished.set()

    def fail(self, error):
        self.error, self.done = error, True
        self.finished.set()

    def cancelled(self):
        return self.done


def _one_request(prefill: PrefillWorker, decode: DecodeWorker, ids: list[int], params: SamplingParams,
                 rid: str) -> tuple[list[int], float, list[float]]:
    """(tokens, TTFT seconds, gaps between streamed tokens) of one request through the pair."""
    t0 = time.perf_counter()
    dsink, psink = _TimedSink(), _TimedSink()
    decode.open(Open(rid, ids, params, writer="p", writer_host=host_identity()), dsink)
    reserved = dsink.replies[0][1]
    if not isinstance(reserved, Reserved):
        raise RuntimeError(f"decode worker refused the reservation: {reserved} {dsink.error}")
    prefill.submit(Prefill(rid, ids, params, destination=reserved.destination), psink)
    if not psink.finished.wait(120) or not isinstance(psink.replies[0][1], Prefilled):
        raise RuntimeError(f"prefill failed: {psink.error}")
    t_first, first = psink.replies[0]
    decode.start(Start(rid, reserved.lease, first.token, first.logprob))
    if not dsink.finished.wait(120) or dsink.error is not None:
        raise RuntimeError(f"decode failed: {dsink.error}")
    stamps = [t_first] + [t for t, r in dsink.replies if isinstance(r, Token) and r.token is not None]
    tokens = [first.token] + [r.token for _, r in dsink.replies if isinstance(r, Token) and r.token is not None]
    return tokens, t_first - t0, [b - a for a, b in zip(stamps, stamps[1:])]


def one_prefill_one_decode(engine: Engine, prompts: list[list[int]], expected: list[list[int]],
                           max_tokens: int, decode_pages: int = 512) -> dict:
    """Run each prompt through the pair in turn; compare with `expected` (the single engine's answers)."""
    registry: dict = {}
    decode_engine = Engine(engine.model, engine.tokenizer, KVCache(engine.kv_layout(), decode_pages, engine.device))
    if engine.graphs is not None:  # the decode worker steps on graphs as a GPU decode role does
        decode_engine.use_decode_graphs(engine.graphs.batch_sizes, capture=engine.graphs.capture)
    host = PoolHost(decode_engine.cache, ("inproc",), registry)
    decode = DecodeWorker(decode_engine, host, transfer_timeout_s=30.0).launch()
    prefill = PrefillWorker(Engine(engine.model, engine.tokenizer, None), registry=registry).launch()
    params = SamplingParams(max_tokens=max_tokens)
    got, ttft, gaps = [], [], []
    try:
        for i, ids in enumerate(prompts):
            tokens, t, g = _one_request(prefill, decode, ids, params, f"pair{i}")
            got.append(tokens)
            ttft.append(t)
            gaps += g
        deadline = time.monotonic() + 10
        while decode.stats().pages_used and time.monotonic() < deadline:
            time.sleep(0.01)  # the decode loop frees a finished request's pages between its steps
    finally:
        prefill.close()
        decode.close()
        host.close()
    leaked = decode_engine.allocator.num_used  # pages still referenced after every request ended
    return {"runtime": RUNTIME, "exact": sum(g == e for g, e in zip(got, expected)), "of": len(expected),
            "ttft_ms_median": round(statistics.median(ttft) * 1e3, 2),
            "itl_ms_median": round(statistics.median(gaps) * 1e3, 3) if gaps else None,
            "itl_ms_p90": round(sorted(gaps)[int(0.9 * (len(gaps) - 1))] * 1e3, 3) if gaps else None,
            "pages_left_in_use": leaked, "answer": engine.tokenizer.decode(got[0])[:80]}
