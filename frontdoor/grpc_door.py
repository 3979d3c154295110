"""Front door 1: the Triton gRPC protocol (KServe v2 GRPCInferenceService), served with grpcio.

Protocol messages are the modules `tritonclient` ships, so `tritonclient.grpc`, perf_analyzer and
genai-perf talk to it as to a Triton server holding one decoupled LLM model (named `ensemble` by
default) with TensorRT-LLM's ensemble tensor contract. Implemented: ServerLive/Ready/Metadata,
ModelReady/Metadata/Config/Statistics, RepositoryIndex (the one model), ModelInfer (whole answer) and
ModelStreamInfer (one response per piece of new text); RepositoryModelLoad/Unload are refused
(UNIMPLEMENTED, naming why: the server serves the model it started with). Other RPCs answer
UNIMPLEMENTED, and only what is implemented is advertised.
A failure's gRPC code comes from its status (tandem/status.py); on a stream it is an error response
whose message starts with the code's name, as Triton's own streams do. A stream whose client reads none
of its responses for `send_s` (limits.send_timeout_s: a write waits that long on HTTP/2 flow control) is
ended, every request on it cancelled, as a client that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from frontdoor.api_keys import ApiKeys
from frontdoor.auth import GrpcKeyInterceptor
from frontdoor.core import FrontDoor
from frontdoor.kserve_codec import (InferCall, decode_call, grpc_inputs, output_tensors, refuse_model_control,
                                    repository_index, to_raw)
from frontdoor.model_contract import INPUTS, OUTPUTS
from frontdoor.protocol_status import describe, grpc_code
from frontdoor.request_ids import GrpcRequestIds
from frontdoor.schedule_policy import grpc_parameters
from tandem import __version__
from tandem.request_context import current_id
from tandem.status import Internal, InvalidArgument, NotFound, TandemError, status_of

EXTENSIONS = ("model_configuration", "statistics", "schedule_policy")
log = logging.getLogger("tandem.grpc")
DEADLINE_MARGIN_S = 0.1  # answer this long before a client's gRPC deadline, so it hears why


class TritonProtocolServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, door: FrontDoor, send_s: float = 30.0):
        """`send_s`: how long a stream's response may wait for its client to read (then the stream ends)."""
        self.door, self.served, self.send_s = door, door.served, send_s
        self.service = door.service
        self.model = door.served.triton_name
        self.stats = door.served.stats
        self._ids = itertools.count()

    # -- health and metadata ------------------------------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.service.ready())

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="tandem", version=__version__, extensions=list(EXTENSIONS))

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self._known(request.name, request.version) and self.service.ready())

    async def ModelMetadata(self, request, context):
        await self._require_model(request.name, request.version, context, grpc.StatusCode.NOT_FOUND)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=self.model, versions=["1"], platform="python",
            inputs=[tensor(name=t.name, datatype=t.datatype, shape=[-1, *t.dims]) for t in INPUTS],
            outputs=[tensor(name=t.name, datatype=t.datatype, shape=[-1, *t.dims]) for t in OUTPUTS])

    async def ModelConfig(self, request, context):
        await self._require_model(request.name, request.version, context, grpc.StatusCode.NOT_FOUND)
        return pb.ModelConfigResponse(config=self.served.config)

    async def ModelStatistics(self, request, context):
        if request.name:
            await self._require_model(request.name, request.version, context, grpc.StatusCode.NOT_FOUND)
        s = self.stats
        infer = pb.InferStatistics(success=pb.StatisticDuration(count=s.success, ns=s.success_ns),
                                   fail=pb.StatisticDuration(count=s.fail, ns=s.fail_ns))
        return pb.ModelStatisticsResponse(model_stats=[pb.ModelStatistics(
            name=self.model, version="1", last_inference=s.last_ms, inference_count=s.success,
            execution_count=s.success, inference_stats=infer)])

    async def RepositoryIndex(self, request, context):
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in
                                                  repository_index(self.served, request.ready)])

    async def RepositoryModelLoad(self, request, context):
        await self._model_control("load", request.model_name, context)

    async def RepositoryModelUnload(self, request, context):
        await self._model_control("unload", request.model_name, context)

    async def _model_control(self, action: str, name: str, context) -> None:
        try:
            refuse_model_control(action, name)
        except TandemError as e:
            await context.abort(grpc_code(status_of(e)), str(e))

    def _known(self, name: str, version: str) -> bool:
        return self.served.known_triton(name, version)

    async def _require_model(self, name, version, context, code):
        if not self._known(name, version):
            await context.abort(code, f"unknown model '{name}' (version '{version}'); this server has "
                                      f"'{self.model}' (version 1)")

    # -- inference: a codec over the front-door core ----------------------------------------------------

    def _call(self, request: pb.ModelInferRequest, context=None) -> InferCall:
        """The decoded call; with a `context` it is a unary ModelInfer (which answers once)."""
        if not self._known(request.model_name, request.model_version):
            raise NotFound(f"unknown model '{request.model_name}'; this server has '{self.model}'")
        remaining = context.time_remaining() if context is not None else None
        # the client's gRPC deadline is this request's, less a margin for the reply
        timeout = max(remaining - DEADLINE_MARGIN_S, 0.001) if remaining is not None else None
        # the client's KServe id, else (one call, one request) the call's request id, else a fresh one
        rid = request.id or (current_id() if context is not None else "") or f"{current_id('grpc')}-{next(self._ids)}"
        return decode_call(grpc_inputs(request), rid, [o.name for o in request.outputs], timeout,
                           unary=context is not None, adapters=self.served.adapters, levels=self.served.levels,
                           parameters=grpc_parameters(request.parameters))

    async def ModelInfer(self, request, context):
        try:
            self.service.refuse_if_closed()  # before the tensors are decoded: a refusal costs almost nothing
            call = self._call(request, context)
            answers = await self.door.collect_all(call.requests)
        except TandemError as e:
            await context.abort(grpc_code(status_of(e)), str(e))
        return self._response(call, [a.text for a in answers], [list(a.logprobs) for a in answers],
                              [a.prompt_tokens for a in answers], [a.tokens for a in answers], final=None)

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests on one stream are served concurrently (a task each, writing its own responses);
        responses interleave, tagged with their request's id. A response its client does not take within
        `send_s` ends the call: every request on the stream is cancelled, the call ends CANCELLED."""
        lock = asyncio.Lock()  # one write at a time on the call
        tasks: set[asyncio.Task] = set()
        call, unread = asyncio.current_task(), ""

        async def write(resp: pb.ModelStreamInferResponse) -> None:
            nonlocal unread
            try:
                async with asyncio.timeout(self.send_s), lock:
                    await context.write(resp)
            except TimeoutError:
                if not unread:
                    unread = (f"the client read none of the stream's responses for {self.send_s:g} s "
                              f"(limits.send_timeout_s): its requests were cancelled")
                    log.warning("ending a stream: %s", unread)
                    call.cancel()
                raise asyncio.CancelledError from None  # this request ends as a cancelled one

        async def serve(request) -> None:
            try:
                await self._stream_one(request, write)
            except TandemError as e:
                await write(_stream_error(request, describe(e)))
            except Exception as e:  # a bug: INTERNAL for this request, the traceback in the log, never silence
                log.exception("internal error serving stream request %r", request.id)
                await write(_stream_error(request, describe(Internal(f"internal error ({type(e).__name__}); "
                                                                     f"see the server log"))))

        try:
            async for request in request_iterator:
                task = asyncio.create_task(serve(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
        except asyncio.CancelledError:
            if not unread:
                raise  # the client cancelled the call, or the server stops
            call.uncancel()  # cancelled by write(): the call ends with a status, after what it holds is read
        finally:
            for t in list(tasks):
                t.cancel()
        if unread:
            await context.abort(grpc.StatusCode.CANCELLED, unread)

    async def _stream_one(self, request, write) -> None:
        self.service.refuse_if_closed()
        call = self._call(request)
        if len(call.requests) != 1:
            raise InvalidArgument("ModelStreamInfer takes one prompt per request")
        req = call.requests[0]
        empty_final = request.parameters.get("triton_enable_empty_final_response")
        empty_final = bool(empty_final and empty_final.bool_param)
        if not call.stream:  # a non-streaming request on the stream: one response with the whole text
            a = await self.door.collect(req)
            await write(pb.ModelStreamInferResponse(infer_response=self._response(
                call, [a.text], [list(a.logprobs)], [a.prompt_tokens], [a.tokens], final=True if empty_final else None)))
            return
        n = sent = 0
        async with contextlib.aclosing(self.door.answer(req)) as deltas:  # a cancel cleans up at once
            async for d in deltas:
                n += d.token is not None
                last = d.finish_reason is not None
                # never an empty response, except Triton's requested empty final one, or the only one
                # there is (an answer whose first token ends it still gets one response)
                if not d.text and not (last and (empty_final or not sent)):
                    continue
                sent += 1
                lp = [d.logprob] if d.logprob is not None else []
                await write(pb.ModelStreamInferResponse(infer_response=self._response(
                    call, [d.text], [lp], [d.prompt_tokens], [n], final=last if empty_final else None)))

    def _response(self, call: InferCall, texts: list[str], logprobs: list[list[float]], n_in: list[int],
                  n_out: list[int], final: bool | None) -> pb.ModelInferResponse:
        """One response holding the outputs the client asked for (none named: all of them)."""
        resp = pb.ModelInferResponse(model_name=self.model, model_version="1", id=call.request_id)
        for spec, arr in output_tensors(texts, logprobs, n_in, n_out, call.wanted):
            resp.outputs.add(name=spec.name, datatype=spec.datatype, shape=list(arr.shape))
            resp.raw_output_contents.append(to_raw(arr))
        if final is not None:
            resp.parameters["triton_final_response"].bool_param = final
        return resp


def _stream_error(request, message: str) -> pb.ModelStreamInferResponse:
    """An error on a stream: the message (prefixed with its gRPC code's name) and the request's id."""
    return pb.ModelStreamInferResponse(error_message=message, infer_response=pb.ModelInferResponse(
        model_name=request.model_name, id=request.id))


async def start_grpc(servicer: TritonProtocolServicer, host: str, port: int,
                     credentials: grpc.ServerCredentials | None = None, keys: ApiKeys | None = None,
                     max_connection_age_s: float | None = None) -> grpc.aio.Server:
    """Serve on host:port (TLS with `credentials`; only callers holding one of `keys`, when given); every
    call gets a request id (frontdoor/request_ids.py). New calls are refused with UNAVAILABLE once the
    service drains. `max_connection_age_s`: a connection is sent GOAWAY after about this long (gRPC adds
    +-10% jitter) and takes no new calls; those in flight finish (no grace limit), and the client's next
    call opens a new connection, which a load balancer may send to another replica."""
    interceptors = [GrpcRequestIds()] + ([GrpcKeyInterceptor(keys)] if keys is not None else [])
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    if max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms", max(1, round(max_connection_age_s * 1000))))
    server = grpc.aio.server(options=options, interceptors=interceptors)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:  # newer grpcio raises where older ones return 0
        bound = 0
    if bound == 0:
        raise OSError(f"the gRPC front door cannot listen on {address}: address in use or not available")
    await server.start()
    return server
