"""Shared pieces of the Triton models: parameters, tensors, errors, and the response-sender sink.

Error responses carry a tag the orchestrator maps to its own errors and retry rules:
  "invalid_argument: ..."  the request is bad; retrying it elsewhere will not help
  "out_of_pages: ..."      the decode pool is full right now: wait for pages to free, or try another worker
  "unavailable: ..."       this worker cannot take it now (transfer failed, ...): retry elsewhere
"""

from __future__ import annotations

import json
import threading

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from engine.errors import EngineError, InvalidRequest, OutOfPages
from engine.transports import TransferError
from tandem.wire import WireError


class Params:
    """The `parameters` block of the model's config.pbtxt, typed on read."""

    def __init__(self, args: dict):
        self.config = json.loads(args["model_config"])
        self.raw = {k: v["string_value"] for k, v in self.config.get("parameters", {}).items()}

    def str(self, key: str) -> str:
        if key not in self.raw:
            raise ValueError(f"model config lacks parameter {key!r}")
        return self.raw[key]

    def int(self, key: str) -> int:
        return int(self.str(key))


def pass_budget(params: Params, device: torch.device) -> int:
    """Prompt tokens per prefill pass: the profile's max_num_tokens, capped on CPU (see profiles.py)."""
    budget = params.int("max_num_tokens")
    return min(budget, params.int("cpu_pass_tokens")) if device.type == "cpu" else budget


def setup_threads(params: Params) -> None:
    torch.set_num_threads(max(1, params.int("threads")))


def error_tag(e: Exception) -> str:
    if isinstance(e, OutOfPages):
        return f"out_of_pages: {e}"
    if isinstance(e, (InvalidRequest, WireError, ValueError)):
        return f"invalid_argument: {e}"
    if isinstance(e, (TransferError, EngineError)):
        return f"unavailable: {e}"
    return f"internal: {type(e).__name__}: {e}"


def error_response(e: Exception):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(error_tag(e)))


def input_json(request, name: str = "request") -> bytes:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        raise InvalidRequest(f"missing input tensor {name!r} (BYTES, one JSON object)")
    arr = t.as_numpy()
    if arr.dtype != np.object_ or arr.size != 1:
        raise InvalidRequest(f"input {name!r} must be BYTES with one element, got {arr.dtype} shape {arr.shape}")
    return arr.reshape(-1)[0]


def input_ids(request, name: str = "input_ids", required: bool = True) -> list[int]:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        if required:
            raise InvalidRequest(f"missing input tensor {name!r} (INT32 token ids)")
        return []
    arr = t.as_numpy()
    if arr.dtype != np.int32:
        raise InvalidRequest(f"input {name!r} must be INT32, got {arr.dtype}")
    return arr.reshape(-1).tolist()


def token_response(tokens: list[int], logprobs: list[float], info: dict, batched: bool = False):
    """`batched`: the model has max_batch_size > 0, so every output carries a leading batch dim of 1."""
    lead = (1,) if batched else ()
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("output_ids", np.array(tokens, dtype=np.int32).reshape(lead + (-1,))),
        pb_utils.Tensor("logprobs", np.array(logprobs, dtype=np.float32).reshape(lead + (-1,))),
        pb_utils.Tensor("response", np.array([json.dumps(info).encode()], dtype=np.object_).reshape(lead + (1,))),
    ])


def json_response(obj: dict):
    return token_response([], [], obj)


class ResponseSink:
    """TokenSink over a decoupled request's response sender: one response per token, then FINAL."""

    def __init__(self, request):
        self.sender = request.get_response_sender()
        self.closed = False

    def send(self, token: int, logprob: float | None, finish_reason: str | None) -> None:
        if self.closed:
            return
        resp = token_response([token], [logprob] if logprob is not None else [],
                              {"finish_reason": finish_reason} if finish_reason else {})
        self._send(resp, final=finish_reason is not None)

    def finish(self, reason: str) -> None:
        self._send(json_response({"finish_reason": reason}), final=True)

    def fail(self, message: str) -> None:
        self._send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"unavailable: {message}")), final=True)

    def cancelled(self) -> bool:
        return self.closed or self.sender.is_cancelled()

    def _send(self, resp, final: bool) -> None:
        if self.closed:
            return
        self.sender.send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        self.closed = final


def respond_once(request, resp) -> None:
    """A decoupled request answered with one response."""
    request.get_response_sender().send(resp, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class BackgroundLoop:
    """A worker's `run(stop)` loop on a daemon thread, owned by a Triton model instance."""

    def __init__(self, worker, name: str):
        self.worker = worker
        self.stop = threading.Event()
        self.thread = threading.Thread(target=worker.run, args=(self.stop,), name=name, daemon=True)
        self.thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        self.stop.set()
        self.worker.wakeup.set()
        self.thread.join(timeout=timeout_s)
