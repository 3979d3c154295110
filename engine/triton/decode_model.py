"""Triton `decode` model (decoupled): owns the KV pool in this stub process and runs the batch loop.
Also the co-located `generate` model (the same worker, every prompt prefilled here): see generate_model.py.

`execute` only dispatches (engine/triton/common.py); replies leave through each request's sender.
"""

from __future__ import annotations

from engine.load import load_engine
from engine.transports.host import PoolHost
from engine.triton.common import dispatch, end_server, instance_device, pass_budget, start_model, worker_handlers
from engine.workers.decode_worker import DecodeWorker
from tandem.call_renewal import Continue
from tandem.roles import Role
from tandem.wire import Open, Release, Start, WriterGone


def handlers(worker: DecodeWorker, configured: dict[str, str]) -> dict:
    """`configured`: the worker's own LoRA adapters (folder by name)."""
    return {
        Open: worker.open,
        Continue: worker.resume,
        Start: lambda msg, sink: worker.start(msg),
        Release: lambda msg, sink: worker.release(msg),
        WriterGone: lambda msg, sink: worker.writer_gone(msg.writer),
        **worker_handlers(worker, configured),
    }


class TritonPythonModel:
    def initialize(self, args):
        p, self.auth, self.tracer = start_model(args, "decode")
        transports = tuple(t for t in p.str("transports").split(",") if t)
        self.engine = load_engine(p.str("engine_dir"), device=instance_device(args), kv_bytes=p.int("kv_pool_bytes"),
                                  shared_kv="shm" in transports, prefix_cache=p.str("prefix_cache") == "on",
                                  lora_modules=p.lora_modules())
        self.pool = PoolHost(self.engine.cache, transports)
        chunk = p.int("chunk_tokens")
        self.worker = DecodeWorker(self.engine, self.pool, role=Role.DECODE, max_batch_size=p.int("max_batch_size"),
                                   pass_tokens=pass_budget(p, self.engine.device), chunk_tokens=chunk or None,
                                   transfer_timeout_s=p.float("transfer_timeout_s"),
                                   fence_timeout_s=p.float("fence_timeout_s"), tracer=self.tracer).launch(end_server)
        self.handlers = handlers(self.worker, p.lora_modules())

    def execute(self, requests):
        dispatch(requests, self.handlers, self.auth)
        return None

    def finalize(self):
        self.worker.close()
        self.tracer.close()
        self.pool.close()
        self.engine.cache.close()
