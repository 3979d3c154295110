"""Front door 1: the Triton gRPC protocol (KServe v2 GRPCInferenceService), served with grpcio.

Protocol messages are the modules `tritonclient` ships, so `tritonclient.grpc`, perf_analyzer and
genai-perf talk to it as to a Triton server holding one decoupled LLM model (named `ensemble` by
default) with TensorRT-LLM's ensemble tensor contract. Implemented: ServerLive/Ready/Metadata,
ModelReady/Metadata/Config/Statistics, ModelInfer (whole answer) and ModelStreamInfer (one response
per piece of new text). Other RPCs answer UNIMPLEMENTED, and only what is implemented is advertised.
A failure's gRPC code comes from its status (tandem/status.py); on a stream it is an error response
whose message starts with the code's name, as Triton's own streams do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from frontdoor.auth import ApiKeys, GrpcKeyInterceptor
from frontdoor.model_contract import INPUTS, OUTPUTS, parse_requests
from frontdoor.protocol_status import describe, grpc_code
from frontdoor.request_ids import GrpcRequestIds
from frontdoor.served_model import ServedModel
from frontdoor.tensors import TensorError, encode_bytes, from_raw, to_raw
from tandem import __version__
from tandem.request_context import current_id
from tandem.status import InvalidArgument, NotFound, TandemError, status_of

EXTENSIONS = ("model_configuration", "statistics")
DEADLINE_MARGIN_S = 0.1  # answer this long before a client's gRPC deadline, so it hears why


class TritonProtocolServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, served: ServedModel):
        self.served = served
        self.service = served.service
        self.model = served.triton_name
        self.stats = served.stats
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

    def _known(self, name: str, version: str) -> bool:
        return self.served.known_triton(name, version)

    async def _require_model(self, name, version, context, code):
        if not self._known(name, version):
            await context.abort(code, f"unknown model '{name}' (version '{version}'); this server has "
                                      f"'{self.model}' (version 1)")

    # -- inference ----------------------------------------------------------------------------------

    def _parse(self, request: pb.ModelInferRequest, context=None):
        if not self._known(request.model_name, request.model_version):
            raise NotFound(f"unknown model '{request.model_name}'; this server has '{self.model}'")
        if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
            raise InvalidArgument("raw_input_contents must have one entry per input")
        inputs = {}
        for i, t in enumerate(request.inputs):
            if t.name in inputs:
                raise InvalidArgument(f"input {t.name!r} given twice")
            raw = request.raw_input_contents[i] if request.raw_input_contents else _contents(t)
            try:
                inputs[t.name] = (t.datatype, from_raw(t.name, t.datatype, list(t.shape), raw))
            except TensorError as e:
                raise InvalidArgument(str(e)) from None
        # the client's KServe id, else (one call, one request) the call's request id, else a fresh one
        rid = request.id or (current_id() if context is not None else "") or \
            f"{current_id('grpc')}-{next(self._ids)}"
        reqs, stream = parse_requests(inputs, rid)
        remaining = context.time_remaining() if context is not None else None
        if remaining is not None:  # the client's gRPC deadline is this request's, less a margin for the reply
            reqs = [dataclasses.replace(r, timeout_s=max(remaining - DEADLINE_MARGIN_S, 0.001)) for r in reqs]
        empty_final = request.parameters.get("triton_enable_empty_final_response")
        wanted = frozenset(o.name for o in request.outputs)
        unknown = wanted - {t.name for t in OUTPUTS}
        if unknown:
            raise InvalidArgument(f"unknown outputs {sorted(unknown)}; this model has "
                                  f"{', '.join(t.name for t in OUTPUTS)}")
        return reqs, stream, bool(empty_final and empty_final.bool_param), rid, wanted

    async def ModelInfer(self, request, context):
        start = time.perf_counter()
        try:
            self.service.refuse_if_closed()  # before the tensors are decoded: a refusal costs almost nothing
            reqs, _, _, rid, wanted = self._parse(request, context)
            preps = [await self.service.prepare(r) for r in reqs]
            results = await asyncio.gather(*[self.served.collect(p) for p in preps])
        except TandemError as e:
            self.stats.record(False, start)
            await context.abort(grpc_code(status_of(e)), str(e))
        self.stats.record(True, start)
        texts = [(p.request.prompt if not p.request.exclude_input else "") + text for p, (text, *_) in
                 zip(preps, results)]
        width = max(len(lp) for _, lp, *_ in results)
        logprobs = np.array([lp + [0.0] * (width - len(lp)) for _, lp, *_ in results], dtype=np.float32)
        return self._response(rid, texts, logprobs, [len(p.prompt_ids) for p in preps], [r[2] for r in results],
                              final=None, wanted=wanted)

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests on one stream are served concurrently; responses interleave, tagged with ids."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def serve(request):
            start = time.perf_counter()
            ok = False
            try:
                async with contextlib.aclosing(self._stream_one(request)) as responses:
                    async for resp in responses:
                        await queue.put(resp)
                        await asyncio.sleep(0)  # let the writer send it before this task starts the next step
                ok = True
            except TandemError as e:
                await queue.put(_stream_error(request, describe(e)))
            finally:
                self.stats.record(ok, start)

        async def read():
            async for request in request_iterator:
                task = asyncio.create_task(serve(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            await queue.put(None)

        reader = asyncio.create_task(read())
        try:
            while (resp := await queue.get()) is not None:
                yield resp
        finally:
            reader.cancel()
            for t in list(tasks):
                t.cancel()

    async def _stream_one(self, request):
        self.service.refuse_if_closed()
        reqs, stream, empty_final, rid, wanted = self._parse(request)
        if len(reqs) != 1:
            raise InvalidArgument("ModelStreamInfer takes one prompt per request")
        prep = await self.service.prepare(reqs[0])
        n_in = len(prep.prompt_ids)
        if not stream:  # a non-streaming request on the stream: one response with the whole text
            text, lp, n, _ = await self.served.collect(prep)
            text = ("" if prep.request.exclude_input else prep.request.prompt) + text
            yield pb.ModelStreamInferResponse(infer_response=self._response(
                rid, [text], np.array([lp], dtype=np.float32), [n_in], [n], final=True if empty_final else None,
                wanted=wanted))
            return
        n = sent = 0
        async with contextlib.aclosing(self.service.stream(prep)) as deltas:  # a cancel cleans up at once
            async for d in deltas:
                n += d.token is not None
                last = d.finish_reason is not None
                # never an empty response, except Triton's requested empty final one, or the only one
                # there is (an answer whose first token ends it still gets one response)
                if not d.text and not (last and (empty_final or not sent)):
                    continue
                sent += 1
                lp = np.array([[d.logprob] if d.logprob is not None else []], dtype=np.float32)
                yield pb.ModelStreamInferResponse(infer_response=self._response(
                    rid, [d.text], lp, [n_in], [n], final=last if empty_final else None, wanted=wanted))

    def _response(self, rid: str, texts: list[str], logprobs: np.ndarray, n_in: list[int], n_out: list[int],
                  final: bool | None, wanted: frozenset = frozenset()) -> pb.ModelInferResponse:
        """One response; `wanted` names the outputs the client asked for (none named: all of them)."""
        b = len(texts)
        lp = logprobs.reshape(b, -1)
        outputs = {
            "text_output": lambda: (encode_bytes(t.encode() for t in texts), [b, 1]),
            "output_log_probs": lambda: (to_raw(lp), list(lp.shape)),
            "cum_log_probs": lambda: (to_raw(lp.sum(axis=1, keepdims=True).astype(np.float32)), [b, 1]),
            "num_input_tokens": lambda: (np.array(n_in, dtype="<i4").tobytes(), [b, 1]),
            "num_output_tokens": lambda: (np.array(n_out, dtype="<i4").tobytes(), [b, 1]),
        }
        resp = pb.ModelInferResponse(model_name=self.model, model_version="1", id=rid)
        for spec in OUTPUTS:
            if wanted and spec.name not in wanted:
                continue
            raw, shape = outputs[spec.name]()
            resp.outputs.add(name=spec.name, datatype=spec.datatype, shape=shape)
            resp.raw_output_contents.append(raw)
        if final is not None:
            resp.parameters["triton_final_response"].bool_param = final
        return resp


def _stream_error(request, message: str) -> pb.ModelStreamInferResponse:
    """An error on a stream: the message (prefixed with its gRPC status name) and the request's id."""
    return pb.ModelStreamInferResponse(error_message=message, infer_response=pb.ModelInferResponse(
        model_name=request.model_name, id=request.id))


def _contents(t) -> bytes:
    """Inputs sent in the typed `contents` fields instead of raw bytes (clients may do either)."""
    c = t.contents
    if t.datatype == "BYTES":
        return encode_bytes(list(c.bytes_contents))
    field = {"INT32": (c.int_contents, np.int32), "UINT64": (c.uint64_contents, np.uint64),
             "FP32": (c.fp32_contents, np.float32), "BOOL": (c.bool_contents, np.bool_),
             "INT64": (c.int64_contents, np.int64)}.get(t.datatype)
    if field is None:
        raise InvalidArgument(f"input {t.name!r}: datatype {t.datatype} is not used by this model")
    return np.array(list(field[0]), dtype=field[1]).tobytes()


async def start_grpc(servicer: TritonProtocolServicer, host: str, port: int,
                     credentials: grpc.ServerCredentials | None = None, keys: ApiKeys | None = None) -> grpc.aio.Server:
    """Serve on host:port (TLS with `credentials`; only callers holding one of `keys`, when given); every
    call gets a request id (frontdoor/request_ids.py). New calls are refused with UNAVAILABLE once the
    service drains."""
    interceptors = [GrpcRequestIds()] + ([GrpcKeyInterceptor(keys)] if keys is not None else [])
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)], interceptors=interceptors)
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
