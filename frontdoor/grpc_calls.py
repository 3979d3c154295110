"""Wrapping every call of a gRPC method handler: the one tool of the gRPC door's interceptors.

A grpc.aio interceptor sees a method once, before any call (`intercept_service`); what it does per call
it does by replacing the handler's behaviour. `around_calls` does that for all four call shapes, and for
both kinds of server-streaming behaviour (one that yields its responses, one that writes them with
`context.write` and returns).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import grpc

# (request streaming, response streaming) -> the handler's field holding the behaviour
_KINDS = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
          (True, True): "stream_stream"}


def behavior_kind(handler: grpc.RpcMethodHandler) -> str:
    """The name of the field of `handler` that holds its behaviour (e.g. "unary_stream")."""
    return _KINDS[(handler.request_streaming, handler.response_streaming)]


def around_calls(handler: grpc.RpcMethodHandler,
                 enter: Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager]) -> grpc.RpcMethodHandler:
    """`handler`, each of whose calls runs inside `enter(context)` (entered before the behaviour starts,
    left when it returns, raises or its stream ends)."""
    kind = behavior_kind(handler)
    behavior = getattr(handler, kind)
    if not handler.response_streaming:
        async def unary(request, context):
            async with enter(context):
                return await behavior(request, context)
        return handler._replace(**{kind: unary})
    if inspect.isasyncgenfunction(behavior):
        async def yielding(request, context):
            async with enter(context):
                async for response in behavior(request, context):
                    yield response
        return handler._replace(**{kind: yielding})

    async def writing(request, context):
        async with enter(context):
            await behavior(request, context)
    return handler._replace(**{kind: writing})
