"""Triton `prefill` model (dynamic batching, decoupled): packed passes over the batch Triton hands us,
each request answered as soon as its pass is done.

Inputs `input_ids` (INT32, ragged) and `request` (BYTES, a PrefillRequest JSON object); one response
per request: `output_ids` (the first token), `logprobs`, `response` (a PrefillResult JSON object).
"""

from __future__ import annotations

from dataclasses import asdict
from engine.load import load_engine
from engine.triton.common import (Params, error_response, input_ids, input_json, respond_once, setup_threads,
                                  token_response)
from engine.workers.prefill import PrefillWorker
from tandem.wire import PrefillRequest, parse


class TritonPythonModel:
    def initialize(self, args):
        p = Params(args)
        setup_threads(p)
        engine = load_engine(p.str("engine_dir"), kv_bytes=None)
        budget = p.int("max_num_tokens")
        if engine.device.type == "cpu":
            budget = min(budget, p.int("cpu_pass_tokens"))
        self.worker = PrefillWorker(engine, max_num_tokens=budget)

    def execute(self, requests):
        batch, where = [], []
        for request in requests:
            try:
                batch.append((input_ids(request), parse(PrefillRequest, input_json(request))))
                where.append(request)
            except Exception as e:  # a malformed request fails alone
                respond_once(request, error_response(e))

        def answer(i, result):
            if isinstance(result, Exception):
                respond_once(where[i], error_response(result))
            else:
                lp = [result.logprob] if result.logprob is not None else []
                respond_once(where[i], token_response([result.token], lp, asdict(result), batched=True))

        if batch:
            self.worker.run(batch, on_result=answer)
        return None

    def finalize(self):
        self.worker.close()
