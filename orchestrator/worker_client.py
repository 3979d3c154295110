"""Async clients for the worker models over Triton's gRPC protocol (`tritonclient.grpc.aio`).

Decoupled models (decode, generate) are reached through bidirectional streams: one stream per call,
ended by Triton's final-response flag. Errors come back as WorkerError with the kind the worker
tagged them with (invalid_argument / out_of_pages / unavailable / internal), or "unreachable" when
the worker could not be reached or vanished mid-call (it died): the service retries elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import asdict

import grpc
import numpy as np
from tritonclient.grpc import InferInput
from tritonclient.grpc import aio
from tritonclient.utils import InferenceServerException

from tandem.wire import DecodeOp, PrefillRequest, PrefillResult, Reservation, WorkerStats, parse

KINDS = ("invalid_argument", "out_of_pages", "unavailable", "internal")


class WorkerError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind

    @classmethod
    def from_exception(cls, e: Exception) -> "WorkerError":
        if isinstance(e, InferenceServerException):
            text = e.message()
        elif isinstance(e, grpc.RpcError):  # raised raw by tritonclient's aio streams
            text = f"{e.code().name}: {e.details()}"
        else:
            text = str(e)
        for kind in KINDS:
            marker = f"{kind}: "
            if marker in text:
                return cls(kind, text.split(marker, 1)[1])
        return cls("unreachable", f"worker unreachable: {text}")


def _json_input(name: str, obj, batched: bool = False) -> InferInput:
    arr = np.array([json.dumps(obj).encode()], dtype=np.object_).reshape((1, 1) if batched else (1,))
    t = InferInput(name, list(arr.shape), "BYTES")
    t.set_data_from_numpy(arr)
    return t


def _ids_input(ids: list[int], batched: bool = False) -> InferInput:
    arr = np.array(ids, dtype=np.int32).reshape((1, -1) if batched else (-1,))
    t = InferInput("input_ids", list(arr.shape), "INT32")
    t.set_data_from_numpy(arr)
    return t


def _info(result) -> dict:
    raw = result.as_numpy("response")
    return json.loads(raw.reshape(-1)[0]) if raw is not None and raw.size else {}


def _is_final(result) -> bool:
    p = result.get_response().parameters.get("triton_final_response")
    return bool(p and p.bool_param)


class WorkerClient:
    def __init__(self, url: str, model: str):
        self.url = url
        self.model = model
        self.client = aio.InferenceServerClient(url)

    async def close(self) -> None:
        await self.client.close()

    async def ready(self) -> bool:
        try:
            return await self.client.is_model_ready(self.model)
        except (InferenceServerException, grpc.RpcError):
            return False

    async def _stream(self, inputs: list[InferInput], request_id: str) -> AsyncIterator:
        """Yield each non-empty response of one decoupled request; raise WorkerError on error."""
        async def one():
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id,
                   "enable_empty_final_response": True}

        stream = self.client.stream_infer(one())
        try:
            async for result, error in stream:
                if error is not None:
                    raise WorkerError.from_exception(error)
                final = _is_final(result)
                if result.as_numpy("response") is not None:
                    yield result
                if final:
                    return
        except (InferenceServerException, grpc.RpcError) as e:
            raise WorkerError.from_exception(e) from None
        finally:
            stream.cancel()
        raise WorkerError("unreachable", f"{self.model} at {self.url} closed the stream before finishing")

    async def call(self, inputs: list[InferInput], request_id: str) -> dict:
        """One request with these inputs; the JSON `response` of its (first) answer."""
        async for result in self._stream(inputs, request_id):
            return _info(result)
        raise WorkerError("internal", f"{self.model} sent no response")


class DecodeClient(WorkerClient):
    def __init__(self, url: str, model: str = "decode"):
        super().__init__(url, model)

    async def op(self, op: DecodeOp) -> dict:
        return await self.call([_json_input("request", asdict(op))], op.request_id or op.op)

    async def reserve(self, op: DecodeOp) -> Reservation:
        return parse(Reservation, await self.op(op))

    async def release(self, request_id: str, lease: str) -> None:
        await self.op(DecodeOp(op="release", request_id=request_id, lease=lease))

    async def stats(self) -> WorkerStats:
        return parse(WorkerStats, await self.op(DecodeOp(op="stats")))

    async def generate(self, op: DecodeOp) -> AsyncIterator[tuple[int | None, float | None, str | None]]:
        """Yield (token or None, logprob, finish_reason) until the stream ends."""
        async for result in self._stream([_json_input("request", asdict(op))], op.request_id):
            yield _token(result)


class ColocatedClient(WorkerClient):
    def __init__(self, url: str, model: str = "generate"):
        super().__init__(url, model)

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: dict) -> AsyncIterator:
        inputs = [_ids_input(prompt_ids), _json_input("request", {"request_id": request_id, "sampling": sampling})]
        async for result in self._stream(inputs, request_id):
            yield _token(result)


def _token(result) -> tuple[int | None, float | None, str | None]:
    ids = result.as_numpy("output_ids")
    lps = result.as_numpy("logprobs")
    token = int(ids.reshape(-1)[0]) if ids is not None and ids.size else None
    logprob = float(lps.reshape(-1)[0]) if lps is not None and lps.size else None
    return token, logprob, _info(result).get("finish_reason")


class PrefillClient(WorkerClient):
    def __init__(self, url: str, model: str = "prefill"):
        super().__init__(url, model)

    async def prefill(self, prompt_ids: list[int], req: PrefillRequest) -> PrefillResult:
        inputs = [_ids_input(prompt_ids, batched=True), _json_input("request", asdict(req), batched=True)]
        return parse(PrefillResult, await self.call(inputs, req.request_id))
