"""Triton `prefill` model (dynamic batching, decoupled): `execute` queues the requests Triton hands us;
a background loop runs packed passes and chunks of long prompts (engine/workers/prefill_worker.py) and
answers each request as soon as its last pass is done. With `handoff` pull its pool is exported over
`transports` (shared memory for a pool in host memory, cuda_ipc for one on a GPU, NIXL) with a fence
table, and holds each prompt's K/V for the decode worker to read.
"""

from __future__ import annotations

from engine.load import load_engine
from engine.transports.host import PoolHost
from engine.triton.common import dispatch, end_server, instance_device, pass_budget, start_model, worker_handlers
from engine.workers.prefill_worker import PrefillWorker
from tandem.modes import HandoffMode
from tandem.wire import Abort, Prefill, ReaderGone, Unhold


class TritonPythonModel:
    def initialize(self, args):
        p, self.auth, self.tracer = start_model(args, "prefill")
        engine = load_engine(p.str("engine_dir"), device=instance_device(args), kv_bytes=None,
                             lora_modules=p.lora_modules())
        budget = pass_budget(p, engine.device)
        caching = p.str("prefix_cache") == "on"
        pull = p.str("handoff") == HandoffMode.PULL
        transports = tuple(t for t in p.str("transports").split(",") if t)
        self.engine, self.pool = engine, None
        if budget < engine.max_context or caching or pull:  # long prompts between chunks, the prefix cache, holds
            layout = engine.kv_layout()
            pages = max(layout.pages_for(engine.max_context), p.int("pool_bytes") // (layout.bytes_per_token *
                                                                                   layout.tokens_per_page))
            engine.attach_pool(pages, prefix_cache=caching, shared=pull and "shm" in transports)
            self.pool = PoolHost(engine.cache, transports) if pull else None
        w = self.worker = PrefillWorker(engine, pass_tokens=budget, write_delay_s=p.float("fault_write_delay_ms") / 1000,
                                        pool=self.pool, tracer=self.tracer,
                                        fence_timeout_s=p.float("fence_timeout_s")).launch(end_server)
        self.handlers = {
            Prefill: w.submit,
            Abort: lambda msg, sink: w.abort(msg.request_id),
            Unhold: lambda msg, sink: w.unhold(msg.request_id, msg.hold, msg.reader_closed),
            ReaderGone: lambda msg, sink: w.reader_gone(msg.reader),
            **worker_handlers(w, p.lora_modules()),
        }

    def execute(self, requests):
        dispatch(requests, self.handlers, self.auth, batched=True)
        return None

    def finalize(self):
        self.worker.close()
        self.tracer.close()
        if self.pool is not None:
            self.pool.close()
            self.engine.cache.close()
