"""Triton `prefill` model (dynamic batching, decoupled): `execute` queues the requests Triton hands us;
a background loop runs packed passes and chunks of long prompts (engine/workers/prefill_worker.py) and
answers each request as soon as its last pass is done.
"""

from __future__ import annotations

from engine.load import load_engine
from engine.triton.common import Auth, Params, instance_device, dispatch, end_server, pass_budget, setup_threads
from engine.workers.prefill_worker import PrefillWorker
from tandem.wire import Abort, Flush, Prefill, Stats, Watch


class TritonPythonModel:
    def initialize(self, args):
        p = Params(args)
        self.auth = Auth()  # before anything slow: a bad secret fails the load at once
        setup_threads(p)
        engine = load_engine(p.str("engine_dir"), device=instance_device(args), kv_bytes=None)
        budget = pass_budget(p, engine.device)
        caching = p.str("prefix_cache") == "on"
        if budget < engine.max_context or caching:  # long prompts between their chunks, and the prefix cache
            layout = engine.kv_layout()
            pages = max(layout.pages_for(engine.max_context), p.int("pool_bytes") // (layout.bytes_per_token *
                                                                                   layout.tokens_per_page))
            engine.attach_pool(pages, prefix_cache=caching)
        w = self.worker = PrefillWorker(engine, pass_tokens=budget,
                                        write_delay_s=p.float("fault_write_delay_ms") / 1000).launch(end_server)
        self.handlers = {
            Prefill: w.submit,
            Abort: lambda msg, sink: w.abort(msg.request_id),
            Watch: lambda msg, sink: w.watch(sink, msg.heartbeat_ms / 1000),
            Stats: lambda msg, sink: w.stats(),
            Flush: lambda msg, sink: w.flush(),
        }

    def execute(self, requests):
        dispatch(requests, self.handlers, self.auth, batched=True)
        return None

    def finalize(self):
        self.worker.close()
