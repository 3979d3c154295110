"""`handoff.tokens_per_call`: an answer goes on over a new decode call every so many tokens (Triton 2.51
keeps every response of a call until it ends: tandem/call_renewal.py). The stack in this process, real
workers in Triton, a streamed gRPC answer."""

from __future__ import annotations

import asyncio

import numpy as np

from tandem.call_renewal import ANSWER_RENEW_AFTER
from tandem.roles import Role
from tests.conftest import leak_check, leak_snapshot
from tests.serve.clients import grpc_stream

TOKENS = 30
EXACTLY = {"min_tokens": (np.array([[TOKENS]], dtype=np.int32), "INT32")}  # with max_tokens: 30 tokens


def test_an_answer_over_a_decode_call_every_few_tokens_is_the_answer_of_one_call(built_engines, tmp_path):
    from ops.deployment import Deployment
    from ops.stack import Stack
    from ops.triton_process import free_port

    before = leak_snapshot()
    grpc_port = free_port()
    dep = Deployment(engines=str(built_engines), kv_pool_bytes=256 << 20, handoff={"tokens_per_call": 4},
                     front_door={"grpc_port": grpc_port, "http_port": free_port()})
    stack = Stack(dep, str(tmp_path), log=lambda *_: None)
    url = f"127.0.0.1:{grpc_port}"

    async def run():
        await stack.start()
        try:
            (decode,) = stack.fleet.role(Role.DECODE)
            client, loop = decode.client, asyncio.get_running_loop()
            submit, sent = client.channel._submit, []
            client.channel._submit = lambda m: (sent.append(m.TYPE), submit(m))[1]  # what goes out, as is
            renewed = await loop.run_in_executor(None, grpc_stream, url, "Tell me about lighthouses.", TOKENS, EXACTLY)
            configured, calls = client.renew_after, [t for t in sent if t in ("open", "continue")]
            client.renew_after = ANSWER_RENEW_AFTER
            whole = await loop.run_in_executor(None, grpc_stream, url, "Tell me about lighthouses.", TOKENS, EXACTLY)
            return configured, calls, renewed, whole
        finally:
            await stack.stop()

    configured, calls, renewed, whole = asyncio.run(run())
    assert leak_check(before) == []
    assert configured == 4
    assert calls == ["open"] + ["continue"] * 7, calls  # 29 tokens from the decode worker, 4 per call
    assert "".join(renewed) == "".join(whole) != ""
