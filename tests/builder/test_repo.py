"""`tandem repo`: templates render to configs Triton itself parses, and a real Triton serves them."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import queue
import socket

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from builder.repo import MODELS, RenderError, RepoOptions, render, render_repo
from ops.triton_process import TritonServer
from control.fleet import Fleet
from control.worker_client import CLIENTS, GenerateClient
from tandem import wire
from tandem.roles import Role
from tandem.sampling_params import SamplingParams
from tandem.status import InvalidArgument
from tandem.wire import WIRE, Open
from tests.conftest import leak_check, leak_snapshot

PROMPT = "Name three planets of the solar system."


def test_every_rendered_config_parses_as_a_triton_model_config(rendered_repo, built_engines):
    for model in MODELS:
        cfg = text_format.Parse((rendered_repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        assert cfg.name == model and cfg.backend == "python"
        assert os.path.isfile(rendered_repo / model / "1" / "model.py")
        assert cfg.parameters["engine_dir"].string_value.startswith(str(built_engines))
    prefill = text_format.Parse((rendered_repo / "prefill" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    decode = text_format.Parse((rendered_repo / "decode" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert prefill.max_batch_size == 8 and prefill.dynamic_batching.max_queue_delay_microseconds == 1000
    assert decode.model_transaction_policy.decoupled and decode.instance_group[0].count == 1


def test_render_fails_on_unfilled_or_unused_keys():
    with pytest.raises(RenderError, match=r"unfilled placeholders \['b'\]"):
        render("a: ${a} b: ${b}", {"a": 1}, "t")
    with pytest.raises(RenderError, match=r"values no placeholder uses \['c'\]"):
        render("a: ${a}", {"a": 1, "c": 2}, "t")
    with pytest.raises(RenderError, match="may not contain quotes"):
        render('a: "${a}"', {"a": 'x" injected'}, "t")


def test_a_pull_prefill_pool_is_exported_over_the_transports_that_reach_its_memory(built_engines):
    from builder.repo import model_values

    def prefill(**kw) -> str:
        return model_values(str(built_engines), RepoOptions(**kw))["prefill"]["transports"]

    assert prefill(handoff="push") == ""  # a push prefill worker exports nothing
    assert prefill(handoff="pull") == "shm" and prefill(handoff="pull", transport="nixl") == "nixl"
    assert prefill(handoff="pull", gpus=(("prefill", 0), ("decode", 0))) == "cuda_ipc"  # its pool is on the GPU
    assert prefill(handoff="pull", transport="auto").split(",")[0] == "shm"
    with pytest.raises(RenderError, match="transport shm cannot reach a prefill pool in GPU memory"):
        prefill(handoff="pull", transport="shm", gpus=(("prefill", 0),))


def test_the_batch_and_pass_limits_given_replace_the_profiles(built_engines):
    """--max-num-seqs caps the decode and co-located workers' batches, --max-num-batched-tokens every
    prefill pass (on the CPU too); left out, the engines' role profiles decide."""
    from builder.repo import model_values
    from tandem.manifest import read_manifest

    own = model_values(str(built_engines), RepoOptions())
    given = model_values(str(built_engines), RepoOptions(max_num_seqs=3, max_num_batched_tokens=128))
    profile = read_manifest(str(built_engines / "decode")).profile
    assert own["decode"]["max_batch_size"] == profile.max_batch_size and own["generate"]["max_batch_size"] == 64
    assert given["decode"]["max_batch_size"] == given["generate"]["max_batch_size"] == 3
    assert given["prefill"]["max_batch_size"] == own["prefill"]["max_batch_size"]  # Triton's batcher: as built
    for model in ("prefill", "decode", "generate"):
        assert given[model]["max_num_tokens"] == given[model]["cpu_pass_tokens"] == 128, model
        assert own[model]["max_num_tokens"] != 128


def test_repo_refuses_engines_that_cannot_pair(built_engines, tmp_path):
    eng = tmp_path / "eng"
    shutil.copytree(built_engines / "prefill", eng / "prefill")
    shutil.copytree(built_engines / "decode", eng / "decode")
    manifest = json.loads((eng / "decode" / "manifest.json").read_text())
    manifest["kv_layout"]["dtype"] = "bfloat16"
    (eng / "decode" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RenderError, match="'dtype': prefill has 'float32', decode has 'bfloat16'"):
        render_repo(str(eng), str(tmp_path / "repo"), RepoOptions())
    assert not (tmp_path / "repo").exists()


@pytest.fixture(scope="module")
def triton_all_models(rendered_repo):
    before = leak_snapshot()
    server = TritonServer(str(rendered_repo), MODELS, name="all-models").start()
    yield server
    server.stop()
    assert leak_check(before) == []


def test_triton_loads_every_model_and_generate_matches_tandem_generate(triton_all_models, built_engines):
    cli = subprocess.run([sys.executable, "-m", "cli.main", "generate", "--model", str(built_engines / "prefill"),
                          "--prompt", PROMPT, "--max-tokens", "24", "--json"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    want = json.loads(cli.stdout)

    async def run():
        clients = {m: CLIENTS[m](triton_all_models.grpc_url) for m in MODELS}
        try:
            stats = {m: (await c.stats()).role for m, c in clients.items()}  # each model answers
            tokens = [t async for t in clients["generate"].open(Open("g1", want["prompt_token_ids"],
                                                                      SamplingParams(max_tokens=24), local_prefill=True))]
            return stats, tokens
        finally:
            for c in clients.values():
                await c.close()

    stats, got = asyncio.run(run())
    assert stats == {"prefill": "prefill", "decode": "decode", "generate": "generate"}
    assert [t.token for t in got] == want["token_ids"]
    assert got[-1].finish_reason == want["finish_reason"]


def test_generate_model_refuses_bad_input_and_keeps_serving(triton_all_models):
    async def run():
        client = GenerateClient(triton_all_models.grpc_url)
        try:
            with pytest.raises(InvalidArgument, match="prompt is empty"):
                [t async for t in client.open(Open("bad", [], SamplingParams(max_tokens=4), local_prefill=True))]
            return [t async for t in client.open(Open("good", [1, 2, 3], SamplingParams(max_tokens=3),
                                                      local_prefill=True))]
        finally:
            await client.close()

    assert len(asyncio.run(run())) == 3


def raw_reply(url: str, model: str, envelope: dict) -> dict:
    """Send one request envelope with plain tritonclient (as any peer could) and return the first reply; the
    envelope speaks this build's wire schema unless it names another."""
    envelope = {"wire": WIRE, **envelope}
    c = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        t = grpcclient.InferInput("request", [1], "BYTES")
        t.set_data_from_numpy(np.array([json.dumps(envelope).encode()], dtype=np.object_))
        c.async_stream_infer(model, [t], request_id="raw")
        result, error = q.get(timeout=60)
        assert error is None, error
        return json.loads(result.as_numpy("reply").reshape(-1)[0])
    finally:
        c.stop_stream()
        c.close()


def test_a_malformed_message_is_a_typed_protocol_error(triton_all_models):
    url = triton_all_models.grpc_url
    cases = [({"type": "open", "body": {"request_id": "b", "prompt_ids": [1], "sampling": {"max_tokens": 0},
                                        "local_prefill": True}}, "max_tokens must be an integer >= 1"),
             ({"type": "open", "body": {"request_id": "b", "prompt_ids": "nope", "sampling": {}}}, "expected a list"),
             ({"type": "explode", "body": {}}, "request must be"),
             ({"type": "prefill", "body": {"request_id": "b", "prompt_ids": [1], "sampling": {}}},
              "does not take 'prefill'"),
             ({"wire": "0123456789ab", "type": "stats", "body": {}}, "different Tandem builds")]
    for envelope, message in cases:
        reply = raw_reply(url, "generate", envelope)
        assert reply["status"] == "PROTOCOL_ERROR" and message in reply["message"], (envelope, reply)


def test_a_worker_the_fleet_cannot_use_is_kept_out_and_the_log_says_why_once(triton_all_models, monkeypatch, caplog):
    """A real worker of another build (the schema differs: faked on this side only, as two builds cannot
    both be installed here) and an address nobody answers at: neither is routed to, each is logged once
    with its reason over several retries, and why_not_ready names both reasons."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused, and nobody else takes the port

    async def run():
        fleet = Fleet(heartbeat_s=0.2, stall_s=1.0)
        fleet.add("prefill@other-build", Role.PREFILL, triton_all_models.grpc_url)
        fleet.add("decode@nobody", Role.DECODE, f"127.0.0.1:{dead.getsockname()[1]}")
        deadline = time.monotonic() + 60
        while not all(w.failures >= 3 for w in fleet.workers.values()):
            assert await fleet.wait_change(fleet.version, deadline), "three failed watches each within 60 s"
        routed = [w.name for w in fleet.workers.values() if w.routable]
        why = fleet.why_not_ready((Role.PREFILL, Role.DECODE))
        await fleet.close()
        return routed, why

    monkeypatch.setattr(wire, "WIRE", "0123456789ab")
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.fleet"):
            routed, why = asyncio.run(run())
    finally:
        dead.close()
    assert routed == []
    logged = sorted(r.getMessage() for r in caplog.records if "is not ready" in r.getMessage())
    assert len(logged) == 2, logged
    assert "decode@nobody" in logged[0] and "Connection refused" in logged[0]
    assert "prefill@other-build" in logged[1] and "different Tandem builds" in logged[1]
    assert why[0].startswith("no prefill worker; prefill@other-build at ") and "different Tandem builds" in why[0]
    assert why[1].startswith("no decode worker; decode@nobody at ") and "Connection refused" in why[1]
