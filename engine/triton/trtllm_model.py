"""Triton `prefill` / `decode` models of a TensorRT-LLM worker (decoupled): one TensorRT-LLM role engine each
(engine/trtllm/adapter.py), on an asyncio loop in this stub process, behind Tandem's wire protocol.

    prefill: Prefill (no destination; output_ids of a resumed request are prompt too) -> TrtllmPrefilled
             (final); the K/V then stay in TensorRT-LLM until a decode engine pulls them or its
             kv_transfer_timeout_ms passes. Abort or the caller going away aborts a running context request
    decode:  TrtllmDecode -> Token... (the last carries finish_reason)
    both:    Abort -> Ack, Watch -> WorkerStats..., Stats -> WorkerStats

Parameters (config.pbtxt, written by builder/trtllm_repo.py): role, model_dir (the checkpoint),
llm_yaml (the role's LLM-API options), gpu_ids (CUDA_VISIBLE_DEVICES of this engine, set before
TensorRT-LLM is imported). A request whose caller goes away is aborted in TensorRT-LLM.
Driven by the orchestrator's TrtllmAttempt (control/trtllm_attempt.py). Not yet run with TensorRT-LLM on
this project's machines (no GPU, TensorRT-LLM not installable here): its tests load a test double of
tensorrt_llm (tests/trtllm/fake_trtllm/, not TensorRT-LLM) in Triton instances of KIND_CPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading

from engine.triton.common import CANCEL_CHECK_S, Auth, Params, dispatch, log
from engine.trtllm.adapter import TrtllmRole
from engine.trtllm.mapping import error_for_exception, remaining
from tandem.call_renewal import watch_pushes
from tandem.pool import host_identity
from tandem.roles import Role
from tandem.status import ProtocolError
from tandem.trtllm_wire import TrtllmDecode
from tandem.wire import Abort, Ack, Prefill, Stats, Watch, WorkerStats


class TritonPythonModel:
    def initialize(self, args):
        p = Params(args)
        self.auth = Auth()  # before anything slow: a bad secret fails the load at once
        os.environ["CUDA_VISIBLE_DEVICES"] = p.str("gpu_ids")
        self.role = Role.parse(p.str("role"))
        self.engine = TrtllmRole(self.role, p.str("model_dir"), p.str("llm_yaml"))
        for warning in self.engine.start():
            log.warning(warning)
        self.inflight: dict[str, tuple[object, int]] = {}  # request id -> (sink, prompt tokens)
        self.host = host_identity()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trtllm-loop", daemon=True)
        self.thread.start()
        self._spawn(self._reap())
        work = {Prefill: self._prefill} if self.role is Role.PREFILL else {TrtllmDecode: self._decode}
        self.handlers = {**work, Abort: self._abort, Stats: lambda msg, sink: self.stats(),
                         Watch: lambda msg, sink: self._spawn(self._watch(sink, msg))}

    def execute(self, requests):
        dispatch(requests, self.handlers, self.auth)
        return None

    def finalize(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.engine.close()

    # -- handlers (Triton's thread): validate, then hand the work to the loop --------------------------

    def _prefill(self, msg: Prefill, sink):
        if msg.destination is not None:
            raise ProtocolError("a TensorRT-LLM prefill worker takes Prefill without a destination: the "
                                "decode engine pulls the K/V itself", "destination")
        sampling = remaining(msg.sampling, len(msg.output_ids))
        ids = list(msg.prompt_ids) + list(msg.output_ids)
        self._spawn(self._run_prefill(msg.request_id, ids, sampling, sink))

    def _decode(self, msg: TrtllmDecode, sink):
        self._spawn(self._run_decode(msg, sink))

    def _abort(self, msg: Abort, sink) -> Ack:
        found = msg.request_id in self.inflight
        self.loop.call_soon_threadsafe(self.engine.abort, msg.request_id)
        return Ack(found=found)

    def stats(self) -> WorkerStats:
        queued = sum(n for _, n in self.inflight.values()) if self.role is Role.PREFILL else 0
        return WorkerStats(role=self.role.value, host=self.host, running=len(self.inflight), queued_tokens=queued)

    # -- the loop ----------------------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _run_prefill(self, request_id: str, ids: list[int], sampling, sink) -> None:
        self.inflight[request_id] = (sink, len(ids))
        try:
            sink.send(await self.engine.prefill(request_id, ids, sampling), final=True)
        except BaseException as e:
            sink.fail(error_for_exception(e, "context"))
        finally:
            self.inflight.pop(request_id, None)

    async def _run_decode(self, msg: TrtllmDecode, sink) -> None:
        self.inflight[msg.request_id] = (sink, len(msg.prompt_ids))
        try:
            async for token in self.engine.decode(msg):
                sink.send(token, final=token.finish_reason is not None)
        except BaseException as e:
            sink.fail(error_for_exception(e, "generation"))
        finally:
            self.inflight.pop(msg.request_id, None)

    async def _watch(self, sink, msg: Watch) -> None:
        """Stats every heartbeat until the caller goes, or for the call's pushes, the last marked `renew`
        (tandem/call_renewal.py)."""
        for _ in range(watch_pushes(msg.renew_after) - 1):
            if sink.cancelled():
                sink.send(self.stats(), final=True)
                return
            sink.send(self.stats())
            await asyncio.sleep(msg.heartbeat_ms / 1000)
        sink.send(dataclasses.replace(self.stats(), renew=True), final=True)

    async def _reap(self) -> None:
        """Abort in TensorRT-LLM every request whose caller went away (Triton cancelled it)."""
        while True:
            await asyncio.sleep(CANCEL_CHECK_S)
            for request_id, (sink, _) in list(self.inflight.items()):
                if sink.cancelled():
                    self.engine.abort(request_id)
