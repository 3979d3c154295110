"""The real TensorRT-LLM adapter: a context_only prefill engine and a generation_only decode engine, built
from the role YAMLs `tandem build --backend tensorrt-llm` writes, hand a request over through TensorRT-LLM's
cache transceiver, and the tokens equal one engine's. Runs wherever tensorrt_llm imports and a GPU is
visible; skipped here (it has not yet run on this project's machines)."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from builder.build import BuildRequest
from builder.trtllm_build import build_trtllm, trtllm_runnable
from engine.trtllm.adapter import TrtllmRole
from tandem.roles import Role
from tandem.sampling_params import SamplingParams
from tandem.status import Status, TandemError
from tandem.trtllm_wire import TrtllmDecode

WHY = trtllm_runnable()
pytestmark = [pytest.mark.trtllm, pytest.mark.skipif(WHY is not None, reason=f"TensorRT-LLM role engines: {WHY}")]


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    out = tmp_path_factory.mktemp("trt") / "engines"
    build_trtllm(BuildRequest(model="smollm2-135m", out=str(out)), dry_run=False, log=lambda *_: None)
    engines = {}
    for role in (Role.PREFILL, Role.DECODE):  # two engines on one GPU: each takes a share of its memory
        path = out / role.value / "llm_api_options.yaml"
        options = yaml.safe_load(path.read_text())
        options["kv_cache_config"]["free_gpu_memory_fraction"] = 0.3
        path.write_text(yaml.safe_dump(options))
        engines[role] = TrtllmRole(role, str(out / role.value), str(path))
        engines[role].start()  # raises SurfaceMismatch when the installed API lacks a field used
    yield engines
    for engine in engines.values():
        engine.close()


def _handoff(roles, request_id: str, ids: list[int], p: SamplingParams):
    async def run():
        first = await roles[Role.PREFILL].prefill(request_id, ids, p)
        assert first.params is not None and first.params.opaque_state
        rest = [t async for t in roles[Role.DECODE].decode(TrtllmDecode(request_id, ids, p, first.params))]
        return first, rest
    return asyncio.run(run())


def test_context_then_generation_equals_one_engine(roles):
    from tensorrt_llm import SamplingParams as TrtSampling

    ids = roles[Role.PREFILL].llm.tokenizer.encode("The capital of France is")
    p = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    first, rest = _handoff(roles, "r1", ids, p)
    tokens = [first.token] + [t.token for t in rest if t.token is not None]
    reference = roles[Role.PREFILL].llm.generate(ids, TrtSampling(max_tokens=12, top_k=1, ignore_eos=True))
    assert tokens == list(reference.outputs[0].token_ids)
    assert rest[-1].finish_reason == "length" and first.logprob is not None
    assert not roles[Role.PREFILL].running and not roles[Role.DECODE].running
    assert not roles[Role.PREFILL].abort("r1")  # a finished context request is no longer the adapter's


def test_a_reused_request_id_is_refused_and_an_aborted_decode_ends_cancelled(roles):
    ids = roles[Role.PREFILL].llm.tokenizer.encode("Count: one, two,")
    p = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run():
        first = await roles[Role.PREFILL].prefill("r2", ids, p)
        stream = roles[Role.DECODE].decode(TrtllmDecode("r2", ids, p, first.params))
        await stream.__anext__()
        with pytest.raises(TandemError, match="already running"):
            roles[Role.DECODE]._submit("r2", ids, {}, None, True)
        assert roles[Role.DECODE].abort("r2")
        with pytest.raises(TandemError) as e:
            async for _ in stream:
                pass
        return e.value.status

    assert asyncio.run(run()) is Status.CANCELLED
    assert not roles[Role.DECODE].running
