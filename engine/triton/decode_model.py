"""Triton `decode` model (decoupled): owns the KV pool in this stub process and runs the batch loop.

Input `request` (BYTES, a DecodeOp JSON object); outputs `output_ids`, `logprobs`, `response`.
`execute` only dispatches and returns None; tokens leave through each request's response sender.
"""

from __future__ import annotations

from dataclasses import asdict

from engine.load import load_engine
from engine.transports import endpoint
from engine.triton.common import (BackgroundLoop, Params, ResponseSink, error_response, input_ids, input_json,
                                  json_response, respond_once, setup_threads)
from engine.workers.decode import DecodeWorker
from tandem.wire import DecodeOp, WireError, parse


class TritonPythonModel:
    def initialize(self, args):
        p = Params(args)
        setup_threads(p)
        transport = p.str("transport")
        self.engine = load_engine(p.str("engine_dir"), kv_bytes=p.int("kv_pool_bytes"), shared_kv=transport == "shm")
        self.endpoint = endpoint(transport, self.engine.cache)
        self.worker = DecodeWorker(self.engine, self.endpoint, lease_s=p.int("lease_ms") / 1000,
                                   transfer_timeout_s=p.int("transfer_timeout_ms") / 1000,
                                   max_batch_size=p.int("max_batch_size"))
        self.loop = BackgroundLoop(self.worker, "decode-loop")

    def execute(self, requests):
        for request in requests:
            try:
                op = parse(DecodeOp, input_json(request))
                if op.op == "generate":
                    if not op.prompt_ids:
                        op = DecodeOp(**dict(asdict(op), prompt_ids=input_ids(request, required=False)))
                    self.worker.generate(op, ResponseSink(request))
                elif op.op == "reserve":
                    respond_once(request, json_response(asdict(self.worker.reserve(op))))
                elif op.op == "release":
                    respond_once(request, json_response({"released": self.worker.release(op)}))
                elif op.op == "stats":
                    respond_once(request, json_response(asdict(self.worker.stats())))
                else:
                    raise WireError(f"unknown op {op.op!r}; allowed: reserve, generate, release, stats")
            except Exception as e:  # every failure becomes this request's error response; others go on
                respond_once(request, error_response(e))
        return None

    def finalize(self):
        self.loop.close()
        self.endpoint.close()
        self.engine.cache.close()
