"""One persistent gRPC stream to one worker model, with every call to it multiplexed on it by id.

The worker models are decoupled Triton models, reachable only through the bidirectional
`ModelStreamInfer`. Opening a stream per call would cost a round trip and a server-side stream each
time; instead a channel keeps one stream open, sends each call as one request on it (its own Triton
request id), and a reader task hands each reply to the call it belongs to. When the stream breaks
(the worker died or restarted), every call still waiting fails with UNAVAILABLE and the next call
opens a new stream.

Replies are tandem.wire envelopes with a typed status; a non-OK status is raised as its
tandem.status exception. `send` posts a call whose reply nobody waits for (a Release or Abort from a
`finally:`, which must not block a request that is being torn down).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from collections.abc import AsyncIterator

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from control.worker_tls import WorkerTls, secret_refusal
from tandem.status import Status, TandemError, Unavailable, error_for
from tandem.wire import Reply, decode_reply, encode_request

log = logging.getLogger(__name__)

_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
            ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]
_END = object()


class _Stream:
    """One open ModelStreamInfer call: what goes out, and the calls waiting for a reply on it."""

    def __init__(self):
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.pending: dict[str, asyncio.Queue] = {}
        self.orphans: dict[str, object] = {}  # abandoned calls: rid -> callback(reply) for what still comes
        self.reader: asyncio.Task | None = None

    def fail_all(self, error: TandemError) -> None:
        for queue in self.pending.values():
            queue.put_nowait(error)
        self.pending.clear()


class WorkerChannel:
    def __init__(self, url: str, model: str, batched: bool = False, auth: tuple[tuple[str, str], ...] = (),
                 tls: WorkerTls | None = None):
        """`batched`: the model has a batch dimension (max_batch_size > 0), so inputs are shaped [1, 1].
        `auth`: request parameters every call carries (the deployment secret). `tls`: verify the worker
        with it; without it, a channel beyond loopback carrying `auth` refuses every call (worker_tls.py)."""
        self.url, self.model, self.batched, self.auth = url, model, batched, auth
        self._refusal = secret_refusal(url, auth, tls)
        if tls is not None:
            self._channel = grpc.aio.secure_channel(url, tls.credentials(), options=_OPTIONS + tls.options())
        else:
            self._channel = grpc.aio.insecure_channel(url, options=_OPTIONS)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._ids = itertools.count()
        self._stream: _Stream | None = None

    # -- calls --------------------------------------------------------------------------------------

    async def call(self, msg, timeout: float | None = None):
        """One request answered by one final reply; returns its body (raises its status)."""
        async for body in self.stream(msg, timeout):
            return body
        raise Unavailable(f"{self.model} at {self.url} ended the call without a reply")

    async def stream(self, msg, timeout: float | None = None, on_orphan=None, then=None) -> AsyncIterator:
        """Each reply body of one request until its final one. `timeout` bounds each wait for a reply.

        `on_orphan(body)`: if the caller stops listening before the final reply, it is called with every
        OK reply body that still arrives for the call (a reservation made for a request that is gone must
        still be released: only its reply says which lease it is).
        `then(body)`: called with a call's final reply body before it is yielded; a message it returns is
        sent as the next call at once, and the stream goes on with that call's replies (an answer renewed
        over Continue calls, tandem/call_renewal.py), in this one generator."""
        stream, rid, queue = self._submit(msg)
        finished = False
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout):  # not wait_for: it can lose a cancel (see paths.py)
                        item = await queue.get()
                except TimeoutError:
                    raise Unavailable(f"{self.model} at {self.url} sent nothing for {timeout:.1f}s "
                                      f"(stalled?)") from None
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                reply, final = item
                if reply.status is not Status.OK:
                    finished = True
                    raise self._error(reply)
                if final:  # this call is over: so is the stream, unless `then` names the next call
                    follow = then(reply.body) if then is not None and reply.body is not None else None
                    finished = follow is None
                    if follow is not None:
                        stream.pending.pop(rid, None)
                        stream, rid, queue = self._submit(follow)
                if reply.body is not None:
                    yield reply.body
                if finished:
                    return
        finally:
            if stream.pending.pop(rid, None) is not None and not finished and on_orphan is not None:
                self._adopt(stream, rid, queue, on_orphan)

    @staticmethod
    def _adopt(stream: _Stream, rid: str, queue: asyncio.Queue, on_orphan) -> None:
        """Hand what the abandoned call already received, and whatever comes later, to on_orphan."""
        while not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, tuple) and item[0].status is Status.OK and item[0].body is not None:
                on_orphan(item[0].body)
            if item is _END or isinstance(item, BaseException) or (isinstance(item, tuple) and item[1]):
                return  # it already ended
        stream.orphans[rid] = on_orphan

    def send(self, msg) -> None:
        """Post a call without waiting for its reply (best effort: lost if the stream is broken or the
        channel closed; never raises)."""
        try:
            stream, rid, _ = self._submit(msg)
        except Unavailable:
            return
        stream.pending.pop(rid, None)

    def _submit(self, msg) -> tuple[_Stream, str, asyncio.Queue]:
        if self._refusal is not None:
            raise Unavailable(self._refusal)
        stream = self._open()
        rid = f"{getattr(msg, 'request_id', msg.TYPE)}/{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        stream.pending[rid] = queue
        stream.outbox.put_nowait(self._request(rid, encode_request(msg)))
        return stream, rid, queue

    def _request(self, rid: str, payload: bytes) -> pb.ModelInferRequest:
        req = pb.ModelInferRequest(model_name=self.model, id=rid)
        req.inputs.add(name="request", datatype="BYTES", shape=[1, 1] if self.batched else [1])
        req.raw_input_contents.append(struct.pack("<I", len(payload)) + payload)
        req.parameters["triton_enable_empty_final_response"].bool_param = True
        for key, value in self.auth:
            req.parameters[key].string_param = value
        return req

    # -- the stream ---------------------------------------------------------------------------------

    def _open(self) -> _Stream:
        if self._stream is not None and not self._stream.reader.done():
            return self._stream
        stream = self._stream = _Stream()
        call = self._stub.ModelStreamInfer(self._requests(stream.outbox))
        stream.reader = asyncio.get_running_loop().create_task(self._read(call, stream))
        return stream

    @staticmethod
    async def _requests(outbox: asyncio.Queue):
        while (req := await outbox.get()) is not None:
            yield req

    async def _read(self, call, stream: _Stream) -> None:
        why = "the stream ended"
        try:
            async for resp in call:
                self._dispatch(stream, resp)
        except grpc.aio.AioRpcError as e:
            why = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            why = "the worker stopped answering"
            call.cancel()
            raise
        finally:
            stream.outbox.put_nowait(None)
            stream.fail_all(Unavailable(f"{self.model} at {self.url} is unreachable ({why})"))

    def _dispatch(self, stream: _Stream, resp: pb.ModelStreamInferResponse) -> None:
        r = resp.infer_response
        final_p = r.parameters.get("triton_final_response")
        final = bool(final_p and final_p.bool_param)
        queue = stream.pending.get(r.id)
        if queue is None:
            orphan = stream.orphans.pop(r.id, None) if final else stream.orphans.get(r.id)
            if orphan is not None and r.raw_output_contents and not resp.error_message:
                reply = _reply(r.raw_output_contents[0])
                if reply.status is Status.OK and reply.body is not None:
                    orphan(reply.body)
            return  # a call nobody waits for any more (sent with send(), or abandoned)
        if resp.error_message:  # Triton itself refused the request (model not ready, bad tensors, ...)
            queue.put_nowait(Unavailable(f"{self.model} at {self.url}: {resp.error_message}"))
            return
        if r.raw_output_contents:
            queue.put_nowait((_reply(r.raw_output_contents[0]), final))
        if final:
            queue.put_nowait(_END)

    def _error(self, reply: Reply) -> TandemError:
        """A non-OK reply as its exception. A refused control message (PROTOCOL_ERROR: we built it, from a
        request already validated) is logged here: it is a bug or a mixed deployment, never the client's."""
        if reply.status is not Status.PROTOCOL_ERROR:
            return error_for(reply.status, reply.message)
        log.error("%s at %s refused a control message: %s", self.model, self.url, reply.message)
        return error_for(reply.status, f"a worker refused a control message (a server fault, see the server "
                                       f"log): {reply.message}")

    def reset(self, why: str) -> None:
        """Give up on the current stream (its worker stalled): every waiting call fails with UNAVAILABLE
        now, and the next call opens a new stream."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.fail_all(Unavailable(f"{self.model} at {self.url}: {why}"))
            stream.reader.cancel()

    async def close(self) -> None:
        """Close the channel; a later call fails with UNAVAILABLE (its worker left the fleet)."""
        self._refusal = f"{self.model} at {self.url}: the channel is closed (the worker left the fleet)"
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.reader.cancel()
            try:
                await stream.reader
            except asyncio.CancelledError:
                pass  # we cancelled it
        await self._channel.close()


def _reply(raw: bytes) -> Reply:
    """The reply envelope in a BYTES output holding one element (4-byte length + bytes)."""
    (n,) = struct.unpack_from("<I", raw, 0)
    try:
        return decode_reply(raw[4:4 + n])
    except TandemError as e:  # a reply we cannot read is the worker's fault, never the client's
        return Reply(Status.INTERNAL, f"unreadable reply from a worker: {e}")

