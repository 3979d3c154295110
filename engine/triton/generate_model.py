"""Triton `generate` model (decoupled): the co-located baseline, prefill and decode in one engine.

Inputs `input_ids` (INT32) and `request` (BYTES: {"request_id": str, "sampling": {...}}); each
response carries one token in `output_ids` (+ `logprobs`), the last one a finish reason in `response`.
"""

from __future__ import annotations

import json

from engine.errors import InvalidRequest
from engine.load import load_engine
from engine.triton.common import (BackgroundLoop, Params, ResponseSink, error_response, input_ids, input_json,
                                  pass_budget, respond_once, setup_threads)
from engine.workers.colocated import ColocatedWorker


class TritonPythonModel:
    def initialize(self, args):
        p = Params(args)
        setup_threads(p)
        chunk = p.int("chunk_tokens")
        engine = load_engine(p.str("engine_dir"), kv_bytes=p.int("kv_pool_bytes"))
        # the same prefill pass budget as the disaggregated prefill worker: a fair baseline
        self.worker = ColocatedWorker(engine, max_batch_size=p.int("max_batch_size"),
                                      max_num_tokens=pass_budget(p, engine.device),
                                      chunk_tokens=chunk or None)
        self.loop = BackgroundLoop(self.worker, "colocated-loop")

    def execute(self, requests):
        for request in requests:
            try:
                body = json.loads(input_json(request))
                if not isinstance(body, dict) or set(body) - {"request_id", "sampling"}:
                    raise InvalidRequest("request must be {\"request_id\": str, \"sampling\": {...}}")
                self.worker.generate(str(body.get("request_id", "")), input_ids(request), body.get("sampling", {}),
                                     ResponseSink(request))
            except Exception as e:  # every failure becomes this request's error response; others go on
                respond_once(request, error_response(e))
        return None

    def finalize(self):
        self.loop.close()
