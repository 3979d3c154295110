"""A client's deadline counts from its request's arrival at the front door: the time spent before the
request is served (tokenizing it, waiting for admission) is part of it, so the server's own answer
reaches the client before the client's gRPC deadline ends the call."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import control.orchestrator
from tests.conftest import leak_check, leak_snapshot
from tests.serve.clients import ensemble_inputs

TOKENIZING_S = 0.6  # the fault: this slow a tokenizer needs a prompt far past the model's limits
CLIENT_TIMEOUT_S = 2.0


def _infer_past_its_deadline(url: str) -> tuple[InferenceServerException, float]:
    """A unary request for far more tokens than fit in the client's deadline -> its error, seconds taken."""
    c = grpcclient.InferenceServerClient(url)
    extra = {"min_tokens": (np.array([[1000]], dtype=np.int32), "INT32")}
    t = time.monotonic()
    try:
        with pytest.raises(InferenceServerException) as e:
            c.infer("ensemble", ensemble_inputs(grpcclient, "Once upon a time", 1000, False, extra),
                    client_timeout=CLIENT_TIMEOUT_S)
        return e.value, time.monotonic() - t
    finally:
        c.close()


def test_a_grpc_deadline_counts_the_time_spent_tokenizing(built_engines, tmp_path, monkeypatch):
    """With the deadline counted from after tokenization, the server would answer TOKENIZING_S late, after
    the client had given up: the client would see gRPC's own "Deadline Exceeded", not the server's why."""
    from ops.deployment import Deployment
    from ops.stack import Stack
    from ops.triton_process import free_port

    real_prepare = control.orchestrator.prepare

    def slow_prepare(*args):
        time.sleep(TOKENIZING_S)
        return real_prepare(*args)

    monkeypatch.setattr(control.orchestrator, "prepare", slow_prepare)
    before = leak_snapshot()
    grpc_port = free_port()
    dep = Deployment(engines=str(built_engines), kv_pool_bytes=256 << 20,
                     front_door={"grpc_port": grpc_port, "http_port": free_port()})
    stack = Stack(dep, str(tmp_path), log=lambda *_: None)

    async def run():
        await stack.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, _infer_past_its_deadline,
                                                                    f"127.0.0.1:{grpc_port}")
        finally:
            await stack.stop()

    error, took = asyncio.run(run())
    assert leak_check(before) == []
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED", error.message()
    assert "the request's deadline passed before it finished" in error.message()
    assert TOKENIZING_S < took < CLIENT_TIMEOUT_S + 1
