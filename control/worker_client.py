"""Typed clients of the worker models, over one multiplexed channel each (control/channel.py).

Every method returns a tandem.wire reply or raises the tandem.status exception its status names:
the orchestrator never looks at error text to decide what to do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from control.channel import WorkerChannel
from control.worker_tls import WorkerTls
from tandem.call_renewal import ANSWER_RENEW_AFTER, WATCH_RENEW_AFTER, Continue
from tandem.trtllm_wire import TrtllmDecode, TrtllmPrefilled
from tandem.roles import Role
from tandem.wire import (Abort, Ack, Adapters, Flush, Open, Prefill, Prefilled, Pulled, ReaderGone, Release, Reserved,
                         Start, Stats, Token, Unhold, Watch, WorkerStats, WriterGone)

CONTROL_TIMEOUT_S = 10.0  # a control call (start, release, stats) answered by no reply in this long: worker stalled
ADAPTERS_TIMEOUT_S = 120.0  # loading LoRA adapters reads their files: an adapter of a large model may take a while


class WorkerClient:
    model = ""
    batched = False

    def __init__(self, url: str, auth: tuple[tuple[str, str], ...] = (), tls: WorkerTls | None = None):
        self.url = url
        self.channel = WorkerChannel(url, self.model, self.batched, auth, tls)

    async def stats(self) -> WorkerStats:
        return await self.channel.call(Stats(), CONTROL_TIMEOUT_S)

    def watch(self, heartbeat_s: float, stall_s: float, owner: str = "",
              renew_after: int = WATCH_RENEW_AFTER) -> AsyncIterator[WorkerStats]:
        """Stats on every change and every `heartbeat_s`; Unavailable when nothing came for `stall_s`.
        `owner`: the orchestrator watching (its LoRA set leaves the worker a while after its last watch).
        The call ends after `renew_after` replies, the last marked `renew` (tandem/call_renewal.py)."""
        return self.channel.stream(Watch(int(heartbeat_s * 1000), owner, renew_after), stall_s)

    async def flush(self) -> Ack:
        return await self.channel.call(Flush(), CONTROL_TIMEOUT_S)

    async def set_adapters(self, owner: str, modules: dict[str, str]) -> Ack:
        """The LoRA adapters orchestrator `owner` needs the worker to hold (folder by key: control/adapters.py)."""
        return await self.channel.call(Adapters(owner, modules), ADAPTERS_TIMEOUT_S)

    def reset(self, why: str) -> None:
        """Fail every call waiting on this worker now (it stalled or left): they resume elsewhere."""
        self.channel.reset(why)

    async def close(self) -> None:
        await self.channel.close()


class DecodeClient(WorkerClient):
    """A decode worker (or, with model 'generate', a co-located one)."""

    model = "decode"
    renew_after = ANSWER_RENEW_AFTER  # tokens per call of an answer (Open.renew_after, tandem/call_renewal.py)

    def open(self, msg: Open) -> AsyncIterator[Reserved | Pulled | Token]:
        """Reserved first (remote prefill; Pulled in the pull handoff), then the request's tokens (after
        Start when pushed); ends with the request. The worker ends a call after `renew_after` tokens, the
        last carrying a `renew` ticket: the stream goes on over a Continue call at once (a failed Continue
        fails it as any failure of the worker would).

        A caller that stops listening before the end releases what it knows of (every attempt releases
        on exit, control/handoff.py); a reservation whose reply it never saw is released here when that
        reply arrives (no writer was ever given its pages). Tokens left unread release nothing: the
        caller knew the lease, so a second Release would reach a lease already ending."""
        def orphaned(body) -> None:
            if isinstance(body, Reserved):
                self.release(msg.request_id, body.lease, writer_closed=True)

        def renewed(body) -> Continue | None:
            return Continue(msg.request_id, body.renew) if isinstance(body, Token) and body.renew else None

        return self.channel.stream(replace(msg, renew_after=self.renew_after), on_orphan=orphaned, then=renewed)

    async def start(self, msg: Start) -> Ack:
        return await self.channel.call(msg, CONTROL_TIMEOUT_S)

    def release(self, request_id: str, lease: str, writer_closed: bool) -> None:
        """Fire and forget: the worker ends the request and answers its Open with CANCELLED."""
        self.channel.send(Release(request_id, lease, writer_closed))

    def writer_gone(self, writer: str) -> None:
        """Fire and forget: prefill worker `writer` is dead, so no lease waits on its writes any longer."""
        self.channel.send(WriterGone(writer))


class GenerateClient(DecodeClient):
    model = "generate"


class PrefillClient(WorkerClient):
    model = "prefill"
    batched = True  # dynamic batching: the model has a batch dimension

    async def prefill(self, msg: Prefill) -> Prefilled:
        return await self.channel.call(msg)

    def prefill_held(self, msg: Prefill) -> AsyncIterator[Prefilled | Ack]:
        """Pull handoff: Prefilled (with its PullSource, unless the first token ended the request), the
        call then staying open while the K/V are held; it ends when the hold does. A caller that stops
        listening before Prefilled arrives has its hold ended here when it does."""
        def orphaned(body) -> None:
            if isinstance(body, Prefilled) and body.source is not None:
                self.unhold(msg.request_id, body.source.hold, reader_closed=True)  # nobody read it

        return self.channel.stream(msg, on_orphan=orphaned)

    def unhold(self, request_id: str, hold: str, reader_closed: bool = False) -> None:
        """Fire and forget: the prefill worker ends the hold (its pages return once no read is in flight;
        `reader_closed`: the caller knows none can be, see engine/workers/holds.py)."""
        self.channel.send(Unhold(request_id, hold, reader_closed))

    def abort(self, request_id: str) -> None:
        self.channel.send(Abort(request_id))

    def reader_gone(self, reader: str) -> None:
        """Fire and forget: decode worker `reader` is dead, so no hold waits on its NIXL reads any longer."""
        self.channel.send(ReaderGone(reader))


class TrtllmPrefillClient(PrefillClient):
    """A TensorRT-LLM prefill worker (engine/triton/trtllm_model.py): a context_only request per Prefill."""

    batched = False  # TensorRT-LLM batches in flight itself: the model has no batch dimension

    async def prefill_trtllm(self, msg: Prefill) -> TrtllmPrefilled:
        """Prefill without destination -> the first token and the context side's TrtllmParams."""
        return await self.channel.call(msg)

    def reader_gone(self, reader: str) -> None:
        """Nothing to do: TensorRT-LLM's cache transceiver bounds what a dead reader leaves on the context
        side (kv_transfer_timeout_ms); this worker holds nothing for Tandem."""


class TrtllmDecodeClient(DecodeClient):
    """A TensorRT-LLM decode worker: a generation_only request per TrtllmDecode."""

    def decode_trtllm(self, msg: TrtllmDecode) -> AsyncIterator[Token]:
        """The tokens after the first; the last one carries finish_reason. Stopping early does not end
        the request on the worker: `abort` does."""
        return self.channel.stream(msg)

    def abort(self, request_id: str) -> None:
        """Fire and forget: the worker aborts the generation_only request in TensorRT-LLM."""
        self.channel.send(Abort(request_id))

    def writer_gone(self, writer: str) -> None:
        """Nothing to do: no page of this worker waits on a prefill worker's writes (TensorRT-LLM pulls
        the K/V itself; a pull from a dead context side fails, and the request is prefilled again)."""


CLIENTS = {Role.PREFILL: PrefillClient, Role.DECODE: DecodeClient, Role.GENERATE: GenerateClient}  # Triton model = role
TRTLLM_CLIENTS = {Role.PREFILL: TrtllmPrefillClient, Role.DECODE: TrtllmDecodeClient}  # backend: tensorrt-llm
