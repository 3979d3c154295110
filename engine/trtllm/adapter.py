"""One role's TensorRT-LLM engine in a Tandem worker: `tensorrt_llm.LLM` (PyTorch backend) built from
the role YAML that `tandem build --backend tensorrt-llm` wrote, driven with disaggregated params.

    prefill role: generate_async(prompt ids, SamplingParams, DisaggregatedParams(request_type="context_only"))
                  -> the first token (+ logprob) and the output's disaggregated_params, as TrtllmParams
    decode role:  generate_async(prompt ids, SamplingParams, streaming=True,
                  DisaggregatedParams(request_type="generation_only", <the TrtllmParams' fields>))
                  -> the tokens after the first; TensorRT-LLM's cache transceiver pulls the K/V from
                  the context side named in opaque_state (NIXL/UCX, per the YAML's cache_transceiver_config)

Written against TensorRT-LLM 1.2.1's LLM API as its source defines it (tensorrt_llm/llmapi/llm.py,
tensorrt_llm/sampling_params.py, tensorrt_llm/disaggregated_params.py, tensorrt_llm/llmapi/llm_args.py,
tensorrt_llm/executor/utils.py; the Triton llmapi model triton_backend/all_models/llmapi/ for how an LLM
is hosted in a Python-backend model): every name used, with the commits read, is in api_surface.json
beside this file, and `start` checks the installed package against it (engine/trtllm/surface.py).
`tensorrt_llm` is imported in `start` only, inside a worker. This adapter has not yet run on this
project's machines (no GPU, TensorRT-LLM not installable): tests/trtllm/test_real.py runs it
wherever both are present.

After the context phase: a finished context_only request keeps its K/V in TensorRT-LLM until a
generation side pulls them, or until its cache transceiver's kv_transfer_timeout_ms (set by `tandem
build`) passes. The adapter keeps nothing of it: `abort` cancels running requests only (the
orchestrator's side: control/trtllm_attempt.py).

Concurrency: `start`, `prefill`, `decode` and `abort` are called on one asyncio loop's thread.
"""

from __future__ import annotations

import time
from dataclasses import fields
from typing import AsyncIterator

from engine.trtllm.llm_options import load_role_options
from engine.trtllm.mapping import (CONTEXT_ONLY, error_for_exception, finish_reason, generation_kwargs,
                                   sampling_kwargs, token_logprob, wire_params)
from engine.trtllm.surface import check_installed
from tandem.roles import Role
from tandem.sampling_params import SamplingParams
from tandem.status import Internal, InvalidArgument, TandemError
from tandem.trtllm_wire import TrtllmDecode, TrtllmPrefilled
from tandem.wire import Token


class TrtllmRole:
    def __init__(self, role: Role, model_dir: str, options_yaml: str):
        self.role, self.model_dir = role, model_dir
        self.options = load_role_options(options_yaml)
        self.llm = None
        self.running: dict[str, object] = {}  # request id -> TensorRT-LLM's RequestOutput (to abort it)

    def start(self) -> list[str]:  # pragma: no cover - needs TensorRT-LLM and a GPU
        """Import tensorrt_llm, check its API against the recorded surface, build the LLM. Returns
        the surface check's warnings; raises SurfaceMismatch when a used field is missing."""
        import tensorrt_llm
        from tensorrt_llm import LLM, SamplingParams as TrtSampling
        from tensorrt_llm.disaggregated_params import DisaggregatedParams, DisaggScheduleStyle
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

        warnings = check_installed(tensorrt_llm.__version__, [f.name for f in fields(DisaggregatedParams)],
                                   [f.name for f in fields(TrtSampling)])
        self._sampling, self._disagg, self._style = TrtSampling, DisaggregatedParams, DisaggScheduleStyle
        self.llm = LLM(model=self.model_dir, backend="pytorch", **update_llm_args_with_extra_dict({}, self.options))
        return warnings

    async def prefill(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> TrtllmPrefilled:
        """Run the context phase; the K/V stay in TensorRT-LLM until a generation side pulls them (or its
        kv_transfer_timeout_ms passes)."""
        t0 = time.perf_counter()
        result = self._submit(request_id, prompt_ids, sampling_kwargs(sampling, context=True),
                              self._disagg(request_type=CONTEXT_ONLY), False)
        try:
            out = await result.aresult()
            c = out.outputs[0]
            # capped at one token, the context phase ends with "length" or "not_finished" when it hands
            # off: only "stop" (an end token) or a request of one token ends the request here
            reason = "stop" if finish_reason(c.finish_reason) == "stop" else "length" if sampling.max_tokens == 1 \
                else None
            params = None if reason else wire_params(c.disaggregated_params)
        except BaseException as e:
            result.abort()
            raise error_for_exception(e, "context") from e
        finally:
            self.running.pop(request_id, None)
        return TrtllmPrefilled(request_id, int(c.token_ids[0]), token_logprob(c, 0), reason, params,
                               compute_seconds=time.perf_counter() - t0)

    async def decode(self, msg: TrtllmDecode) -> AsyncIterator[Token]:
        """The tokens after the first, as they come; the last one carries finish_reason. Closing the
        iterator early aborts the TensorRT-LLM request."""
        dp = self._disagg(**generation_kwargs(msg.params, style=lambda name: self._style[name]))
        result = self._submit(msg.request_id, msg.prompt_ids, sampling_kwargs(msg.sampling), dp, True)
        sent = len(msg.params.first_gen_tokens)  # the outputs start with them (api_surface.json: assumption)
        finished = False
        try:
            async for out in result:
                c = out.outputs[0]
                finished = bool(out.finished)
                reason = finish_reason(c.finish_reason) if finished else None
                new = list(c.token_ids[sent:])
                for i, token in enumerate(new):
                    yield Token(int(token), token_logprob(c, sent + i), reason if i == len(new) - 1 else None)
                sent = max(sent, len(c.token_ids))
                if finished:
                    if not new:
                        yield Token(None, None, reason or "stop")
                    return
            raise Internal("TensorRT-LLM's stream ended before the request finished")
        except TandemError:
            raise
        except BaseException as e:
            raise error_for_exception(e, "generation") from e
        finally:
            self.running.pop(msg.request_id, None)
            if not finished:
                result.abort()

    def abort(self, request_id: str) -> bool:
        """Cancel a running request; False when none runs under that id."""
        result = self.running.pop(request_id, None)
        if result is not None:
            result.abort()
        return result is not None

    def close(self) -> None:  # pragma: no cover - needs TensorRT-LLM and a GPU
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    def _submit(self, request_id: str, prompt_ids: list[int], sampling: dict, dp, streaming: bool):
        if request_id in self.running:
            raise InvalidArgument(f"request {request_id!r} is already running on this worker", "request_id")
        try:
            result = self.llm.generate_async(list(prompt_ids), self._sampling(**sampling),
                                             streaming=streaming, disaggregated_params=dp)
        except BaseException as e:
            raise error_for_exception(e, "submit") from e
        self.running[request_id] = result
        return result
