"""Triton `prefill` model (dynamic batching): one packed pass per batch Triton hands us.

Inputs `input_ids` (INT32, ragged) and `request` (BYTES, a PrefillRequest JSON object); outputs
`output_ids` (the first token), `logprobs`, `response` (a PrefillResult JSON object).
"""

from __future__ import annotations

from dataclasses import asdict
from engine.load import load_engine
from engine.triton.common import Params, error_response, input_ids, input_json, setup_threads, token_response
from engine.workers.prefill import PrefillWorker
from tandem.wire import PrefillRequest, parse


class TritonPythonModel:
    def initialize(self, args):
        p = Params(args)
        setup_threads(p)
        self.worker = PrefillWorker(load_engine(p.str("engine_dir"), kv_bytes=None),
                                    max_num_tokens=p.int("max_num_tokens"))

    def execute(self, requests):
        responses = [None] * len(requests)
        batch, where = [], []
        for i, request in enumerate(requests):
            try:
                batch.append((input_ids(request), parse(PrefillRequest, input_json(request))))
                where.append(i)
            except Exception as e:  # a malformed request fails alone
                responses[i] = error_response(e)
        for i, result in zip(where, self.worker.run(batch) if batch else []):
            if isinstance(result, Exception):
                responses[i] = error_response(result)
            else:
                lp = [result.logprob] if result.logprob is not None else []
                responses[i] = token_response([result.token], lp, asdict(result), batched=True)
        return responses

    def finalize(self):
        self.worker.close()
