"""The TensorRT-LLM handoff, orchestrator side: one attempt of one request on a TensorRT-LLM prefill
worker and a TensorRT-LLM decode worker (engine/triton/trtllm_model.py), chosen by `backend:
tensorrt-llm`. It has the shape of Tandem's own pull (control/pull_attempt.py), with TensorRT-LLM
moving the K/V itself:

    PREFILL   prefill(prompt, no destination) -> TrtllmPrefilled(first token, TrtllmParams): a
      │       context_only request; its K/V stay inside the prefill worker's TensorRT-LLM
    FIRST     the first token goes to the client at once (a first token that ends the request: done,
      │       no decode worker is involved)
    DECODE    decode(TrtllmDecode(prompt, the params)) -> a generation_only request; TensorRT-LLM's
      │       cache transceiver pulls the K/V from the context side the params name
    PULLED    the decode worker's first token proves the K/V arrived (see "Metrics")
    DONE      the decode stream ends with a token that carries a finish reason

Every exit that is not DONE sends, without waiting, an Abort to the prefill worker while its context
request still runs, and an Abort to the decode worker while its generation request still runs.
A context request that already answered is not Tandem's to free: its K/V stay in TensorRT-LLM until
a generation side pulls them or the role YAML's cache_transceiver_config.kv_transfer_timeout_ms
passes (TensorRT-LLM's own bound; `tandem build` sets it). If this process dies, Triton cancels its
calls and the workers abort them in TensorRT-LLM.

Blame, for the serving path's retry (control/serving_path.py): a failure of the prefill call is the
prefill worker's; a TRANSFER_FAILED from the decode worker before its first token (the pull failed)
is the prefill side's, as in Tandem's pull, so the retry prefills the request again on another pair;
any other decode failure is the decode worker's. A resumed request carries the tokens already
streamed (`sent`): they are prefilled with the prompt and not streamed again. A request setting a
sampling field the adapter does not map (engine/trtllm/mapping.py: NOT_CARRIED) is refused with
INVALID_ARGUMENT before any worker is asked.

Metrics: `on_first` when the prefill worker answered (its compute time; no KV bytes or KV wait: the
K/V move inside TensorRT-LLM), `on_pulled` at the decode worker's first token. The time from the
first token to that one is the decode-side wait for the K/V plus one decode step: an upper bound of
the wait, recorded as such (tandem_kv_wait_seconds{handoff="trtllm"}).

No KV byte and no TensorRT-LLM object passes through here: only the typed TrtllmParams
(tandem/trtllm_wire.py). This attempt has not run against real TensorRT-LLM on this project's
machines; its tests drive workers hosting a test double of the package (tests/trtllm/fake_trtllm/).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from control.fleet import WorkerState
from control.handoff import PairAttempt, blame
from engine.trtllm.mapping import refuse_not_carried, remaining
from tandem.status import Status, TandemError, Unavailable, status_of
from tandem.trtllm_wire import TrtllmDecode, TrtllmPrefilled
from tandem.wire import Prefill, Token


class TrtllmAttempt(PairAttempt):
    """The TensorRT-LLM protocol on one decode and one prefill worker (see the module docstring)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.prefilled: TrtllmPrefilled | None = None
        self.prefilling = False  # the context request may still run on the prefill worker
        self.awaiting_kv = False  # the generation request runs and has produced no token yet
        self.on_pulled: Callable[[], None] | None = None  # called once at the decode worker's first token

    async def next(self) -> Token | None:
        if self.prefilled is None:
            return await self._first_token()
        if self.opened is None and not self.finished:  # the first token went out: decode pulls, then streams
            self._decode()
        tok = await self._stream_next()
        if self.awaiting_kv:
            self.awaiting_kv = False
            self.mark_placed()
            self.timings.pulled_at = time.perf_counter()
            if self.on_pulled is not None:
                self.on_pulled()
        return tok

    async def _first_token(self) -> Token:
        """PREFILL: the context_only request on the prefill worker; the first token."""
        p, t = self.prefill, self.timings
        refuse_not_carried(self.params)  # INVALID_ARGUMENT before any worker is asked
        self.prefilling = True
        try:
            first = await p.client.prefill_trtllm(Prefill(self.request_id, self.prompt_ids, self.params, self.sent))
        except TandemError as e:
            raise blame(e, p) from None
        self.prefilling = False
        if not isinstance(first, TrtllmPrefilled):
            raise blame(Unavailable(f"{p.name} answered a TensorRT-LLM prefill of {self.request_id} with "
                                    f"{type(first).__name__}"), p)
        if first.finish_reason is None and first.params is None:
            raise blame(Unavailable(f"{p.name} returned no disaggregated params for {self.request_id}"), p)
        self.prefilled = first
        t.first_token, t.prefilled, t.transport = time.perf_counter(), first, "trtllm"
        t.reserved = t.start  # nothing waited for a decode worker before the prefill
        if self.on_first is not None:
            self.on_first()
        self.finished = first.finish_reason is not None
        return Token(first.token, first.logprob, first.finish_reason)  # TensorRT-LLM's: no alternatives, no cache

    def _decode(self) -> None:
        """DECODE: the generation_only request with the context side's params (it pulls the K/V)."""
        ids = self.prompt_ids + self.sent
        msg = TrtllmDecode(self.request_id, ids, remaining(self.params, len(self.sent)), self.prefilled.params)
        self.opened = self.decode.client.decode_trtllm(msg)
        self.awaiting_kv = True

    def _stream_culprit(self, e: TandemError) -> WorkerState:
        """A pull that failed before any decode token is the context side's (its K/V are gone or
        unreachable): the retry prefills again, on another prefill worker if there is one."""
        if self.awaiting_kv and status_of(e) is Status.TRANSFER_FAILED:
            return self.prefill
        return self.decode

    async def __aexit__(self, *exc) -> None:
        """Every exit that is not DONE: Abort a running context request and a running generation request
        (both without waiting)."""
        if self.prefilling:
            self.prefill.client.abort(self.request_id)
        if self.opened is not None and not self.ended:
            self.decode.client.abort(self.request_id)
        await super().__aexit__(*exc)
