"""Shared pieces of the Triton models: config parameters, the reply sink, and typed dispatch.

Every model takes one input `request` (BYTES: a tandem.wire request envelope) and answers through the
request's response sender with one or more `reply` outputs (BYTES: a reply envelope carrying a typed
status). Errors are replies with a non-OK status, never Triton errors: the status survives the trip
typed, and a reply always carries its request id. `dispatch` routes each message by its type to the
handler the model registered for it, so no message is dispatched by name.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from engine.lora_files import parse_modules
from engine.workers.adapter_set import AdapterSet
from tandem.logs import setup_logging
from tandem.request_context import begin, end
from tandem.secret import PARAMETER, load_secret
from tandem.status import ProtocolError, Status, Unauthenticated, status_of
from tandem.tracing import TraceConfig, Tracer, make_tracer
from tandem.wire import Adapters, Flush, Stats, Watch, decode_request, encode_reply

if TYPE_CHECKING:
    from engine.workers.decode_worker import DecodeWorker
    from engine.workers.prefill_worker import PrefillWorker

log = logging.getLogger("tandem.worker")
CANCEL_CHECK_S = 0.25  # is_cancelled() is an IPC to the server: ask at most this often per request


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

    def float(self, key: str) -> float:
        return float(self.str(key))

    def lora_modules(self) -> dict[str, str]:
        """The LoRA adapters requests may name: folder by name (engine/lora.py: modules_text)."""
        return parse_modules(self.str("lora_modules"))


def instance_device(args: dict) -> str:
    """Where Triton placed this instance: `cuda:N` for a KIND_GPU instance (N in this process's numbering:
    a local worker sees its own GPU as 0, see ops/gpu_plan.py), else `cpu`."""
    if args.get("model_instance_kind") == "GPU":
        return f"cuda:{int(args['model_instance_device_id'])}"
    return "cpu"


def pass_budget(params: Params, device: torch.device) -> int:
    """Prompt tokens per prefill pass: the profile's max_num_tokens, capped on CPU (see profiles.py)."""
    budget = params.int("max_num_tokens")
    return min(budget, params.int("cpu_pass_tokens")) if device.type == "cpu" else budget


def end_server(error: BaseException) -> None:
    """A worker's loop thread died (a bug). Its heartbeats would go on while its requests hang, so end
    the whole server (its process group: tritonserver and its stubs) at once; the supervisor sees the
    exit, replaces the worker and removes its shared memory."""
    log.critical("the worker loop died; ending this server so that it is replaced", exc_info=error)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def start_model(args: dict, role: str) -> tuple[Params, Auth, Tracer]:
    """What every worker model does first: read its parameters; load the deployment secret (before
    anything slow, so a bad secret fails the load at once); set torch's threads and this stub's log lines
    (to Triton's log, in the format its worker was given, TANDEM_LOG_FORMAT, each naming the request it
    is about); and make the tracer its environment asks for (TANDEM_OTLP_ENDPOINT or the OTEL_*
    variables: the stack passes its own on, ops/local_workers.py; NOOP when none, and opentelemetry is
    never imported) for the spans of traced requests, exported from this process."""
    params = Params(args)
    auth = Auth()
    torch.set_num_threads(max(1, params.int("threads")))
    setup_logging(os.environ.get("TANDEM_LOG_FORMAT", "text"), logging.WARNING)
    return params, auth, make_tracer(TraceConfig.from_env(os.environ, role=role))


def worker_handlers(worker: PrefillWorker | DecodeWorker, configured: dict[str, str]) -> dict:
    """The calls a prefill and a decode worker answer alike: Watch, Stats, Flush, and Adapters for the
    worker's own LoRA adapters (`configured`: folder by name), which expire with their owner's watch."""
    adapters = AdapterSet(worker.engine, configured, lambda: worker.watchers.push(force=True))
    worker.watchers.on_owner_gone = adapters.owner_gone
    worker.watchers.on_owner_back = adapters.owner_back
    return {
        Watch: lambda msg, sink: worker.watch(sink, msg.heartbeat_ms / 1000, msg.owner, msg.renew_after),
        Stats: lambda msg, sink: worker.stats(),
        Flush: lambda msg, sink: worker.flush(),
        Adapters: adapters.apply,
    }


class ResponseSink:
    """A Responder over one request's response sender: replies until the final one."""

    def __init__(self, request, batched: bool = False):
        self.sender = request.get_response_sender()
        self.shape = (1, 1) if batched else (1,)  # a model with max_batch_size > 0 has a batch dimension
        self.done = False
        self._gone = False
        self._checked = 0.0

    def send(self, body, final: bool = False) -> None:
        self._send(encode_reply(body), final)

    def fail(self, error: BaseException) -> None:
        status = status_of(error)
        if status is Status.INTERNAL:
            log.error("internal error", exc_info=error)
        elif status is Status.PROTOCOL_ERROR:  # the orchestrator's bug or a mixed deployment: worth a line
            log.warning("refused a control message: %s", error)
        self._send(encode_reply(status=status, message=str(error) or type(error).__name__), final=True)

    def cancelled(self) -> bool:
        if self._gone or self.done:
            return True
        now = time.monotonic()
        if now - self._checked >= CANCEL_CHECK_S:
            self._checked = now
            self._gone = self.sender.is_cancelled()
        return self._gone

    def _send(self, raw: bytes, final: bool) -> None:
        """Send one reply. Once a send failed (the request was cancelled, its stream is gone) replies are
        dropped and only the final flag goes out: it lets Triton retire the request. A final send is
        made once: the sender closes itself before that send goes out, so one that failed cannot be
        tried again (a retry raises "closed")."""
        if self.done:
            return
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            if self._gone:  # nobody listens; only the final flag matters
                if final:
                    self.sender.send(flags=flags)
            else:
                self.sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("reply", np.array([raw], dtype=np.object_).reshape(self.shape))]), flags=flags)
        except pb_utils.TritonModelException:
            self._gone = True
            if not final:
                return  # the final reply, when it comes, sends the bare flag
        self.done = final


class Auth:
    """The deployment secret this worker requires of callers (tandem/secret.py), if it has one."""

    def __init__(self):
        self.secret = load_secret()

    def check(self, request) -> None:
        if self.secret is None:
            return
        try:
            given = json.loads(request.parameters() or "{}").get(PARAMETER, "")
        except (ValueError, AttributeError):
            given = ""
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), self.secret.encode()):
            raise Unauthenticated("this worker serves only callers that present the deployment's secret")


def dispatch(requests, handlers: dict, auth: Auth, batched: bool = False) -> None:
    """Route each request's message to `handlers[type(message)](message, sink)`. A handler either
    returns a reply (sent as the final one) or None (it answers through the sink itself, later).
    A caller without the deployment's secret (when the worker has one) gets UNAUTHENTICATED."""
    for request in requests:
        sink = ResponseSink(request, batched)
        token = None
        try:
            auth.check(request)
            tensor = pb_utils.get_input_tensor_by_name(request, "request")
            if tensor is None:
                raise ProtocolError("missing input tensor 'request' (BYTES: one JSON envelope)")
            arr = tensor.as_numpy()
            if arr.dtype != np.object_ or arr.size != 1:
                raise ProtocolError(f"input 'request' must be BYTES with one element, got shape {arr.shape}")
            msg = decode_request(arr.reshape(-1)[0])
            if getattr(msg, "request_id", ""):
                token = begin(msg.request_id)[1]  # what is logged while handling it names its request
            handler = handlers.get(type(msg))
            if handler is None:
                raise ProtocolError(f"this model does not take {msg.TYPE!r}; it takes "
                                    f"{sorted(c.TYPE for c in handlers)}")
            reply = handler(msg, sink)
            if reply is not None:
                sink.send(reply, final=True)
        except Exception as e:  # every failure becomes this request's reply, with its status; others go on
            sink.fail(e)
        finally:
            if token is not None:
                end(token)
