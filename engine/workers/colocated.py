"""The co-located baseline worker: one engine does prefill and decode (mixed or chunked batching).

Requests arrive from Triton's threads into an inbox; the loop thread owns the scheduler, so all
engine state is touched by one thread. See engine/scheduler.py for the two batching policies.
"""

from __future__ import annotations

import threading
from collections import deque

from engine.engine import Engine
from engine.errors import EngineError
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.workers.sink import TokenSink


class ColocatedWorker:
    def __init__(self, engine: Engine, *, max_batch_size: int = 64, max_num_tokens: int = 8192,
                 chunk_tokens: int | None = None):
        self.engine = engine
        self.scheduler = Scheduler(engine, max_batch_size, max_num_tokens, chunk_tokens)
        self.inbox: deque = deque()
        self.sinks: dict[str, TokenSink] = {}
        self.lock = threading.Lock()
        self.wakeup = threading.Event()

    def generate(self, request_id: str, prompt_ids: list[int], sampling: dict, sink: TokenSink) -> None:
        """Queue a request; raises InvalidRequest at once for a bad one (nothing is queued)."""
        seq = self.engine.new_sequence(request_id, prompt_ids, SamplingParams.from_dict(sampling))
        with self.lock:
            if request_id in self.sinks or any(s.request_id == request_id for s, _ in self.inbox):
                raise EngineError(f"request id {request_id!r} is already in flight here")
            self.inbox.append((seq, sink))
        self.wakeup.set()

    def stats(self) -> dict:
        a = self.engine.allocator
        return {"role": "colocated", "pages_total": a.num_pages, "pages_used": a.num_used,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)}

    def step(self) -> bool:
        with self.lock:
            while self.inbox:
                seq, sink = self.inbox.popleft()
                try:
                    self.scheduler.add(seq)
                except EngineError as e:
                    sink.fail(str(e))
                    continue
                self.sinks[seq.request_id] = sink
        for rid, sink in list(self.sinks.items()):
            if sink.cancelled():
                self.scheduler.abort(rid)
                del self.sinks[rid]
                sink.finish("abort")
        if not self.scheduler.has_work:
            return False
        for ev in self.scheduler.step():
            reason = ev.seq.finish_reason.value if ev.seq.finished else None
            sink = self.sinks[ev.seq.request_id]
            sink.send(ev.token, ev.logprob, reason)
            if reason:
                del self.sinks[ev.seq.request_id]
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.step():
                self.wakeup.wait(0.1)
                self.wakeup.clear()
