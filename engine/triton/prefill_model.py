"""Triton `prefill` model (dynamic batching, decoupled): `execute` queues the requests Triton hands
us; a background loop runs packed passes and chunks of long prompts (engine/workers/prefill.py) and
answers each request as soon as its last pass is done.

Inputs `input_ids` (INT32, ragged) and `request` (BYTES, a PrefillRequest JSON object); one response
per request: `output_ids` (the first token), `logprobs`, `response` (a PrefillResult JSON object).
"""

from __future__ import annotations

from dataclasses import asdict

from engine.load import load_engine
from engine.triton.common import (BackgroundLoop, Params, error_response, input_ids, input_json, pass_budget,
                                  respond_once, setup_threads, token_response)
from engine.workers.prefill import PrefillWorker
from tandem.wire import PrefillRequest, parse


class TritonPythonModel:
    def initialize(self, args):
        p = Params(args)
        setup_threads(p)
        engine = load_engine(p.str("engine_dir"), kv_bytes=None)
        budget = pass_budget(p, engine.device)
        if budget < engine.max_context:  # a local pool holds a long prompt between its chunks
            engine.attach_pool(engine.kv_layout().pages_for(engine.max_context))
        self.worker = PrefillWorker(engine, pass_tokens=budget)
        self.loop = BackgroundLoop(self.worker, "prefill-loop")

    def execute(self, requests):
        for request in requests:
            try:
                ids, req = input_ids(request), parse(PrefillRequest, input_json(request))
            except Exception as e:  # a malformed request fails alone
                respond_once(request, error_response(e))
                continue
            self.worker.submit(ids, req, lambda result, request=request: respond_once(request, _response(result)))
        return None

    def finalize(self):
        self.loop.close()
        self.worker.close()


def _response(result):
    if isinstance(result, Exception):
        return error_response(result)
    lp = [result.logprob] if result.logprob is not None else []
    return token_response([result.token], lp, asdict(result), batched=True)
