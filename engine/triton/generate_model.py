"""Triton `generate` model (decoupled): the co-located worker, prefill and decode in one engine.

It is the decode worker with no pool for writers from outside (`Open` with local_prefill only), by
the prefill-first policy or chunked prefill (`chunk_tokens` > 0): see engine/scheduler.py.
"""

from __future__ import annotations

from engine.load import load_engine
from engine.triton.common import dispatch, end_server, instance_device, pass_budget, start_model
from engine.triton.decode_model import handlers
from engine.workers.decode_worker import DecodeWorker
from tandem.roles import Role


class TritonPythonModel:
    def initialize(self, args):
        p, self.auth, self.tracer = start_model(args, "generate")
        engine = load_engine(p.str("engine_dir"), device=instance_device(args), kv_bytes=p.int("kv_pool_bytes"),
                             prefix_cache=p.str("prefix_cache") == "on", lora_modules=p.lora_modules())
        chunk = p.int("chunk_tokens")
        # the same prefill pass budget as the disaggregated prefill worker: a fair baseline
        self.worker = DecodeWorker(engine, None, role=Role.GENERATE, max_batch_size=p.int("max_batch_size"),
                                   pass_tokens=pass_budget(p, engine.device),
                                   chunk_tokens=chunk or None, tracer=self.tracer).launch(end_server)
        self.handlers = handlers(self.worker, p.lora_modules())

    def execute(self, requests):
        dispatch(requests, self.handlers, self.auth)
        return None

    def finalize(self):
        self.worker.close()
        self.tracer.close()
