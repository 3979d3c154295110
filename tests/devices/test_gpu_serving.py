"""On a CUDA machine: `tandem serve --device cuda` serves through real Tritons with both workers on one GPU
and the KV handed over by cuda_ipc, answering exactly as the same engines on the CPU (fp32, greedy)."""

from __future__ import annotations

import pytest

from ops.deployment import load_deployment
from ops.stack import local_gpus
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import grpc_infer
from tests.serve.test_modes import PROMPTS

pytestmark = pytest.mark.gpu


def answers(engines, workdir, *extra) -> list[str]:
    s = start_serve(engines, workdir, *extra)
    try:
        return [grpc_infer(s.grpc, p, 16) for p in PROMPTS]
    finally:
        stop_serve(s)


def test_1p1d_on_one_gpu_over_cuda_ipc_answers_as_the_cpu(built_engines, tmp_path):
    want = answers(built_engines, tmp_path / "cpu", "--device", "cpu")
    got = answers(built_engines, tmp_path / "gpu", "--device", "cuda", "--transport", "cuda_ipc")
    assert got == want
    decode = (tmp_path / "gpu" / "model_repository" / "decode" / "config.pbtxt").read_text()
    assert "KIND_GPU count: 1 gpus: [ 0 ]" in decode and 'string_value: "cuda_ipc"' in decode


def test_colocated_on_a_gpu_answers_as_the_cpu(built_engines, tmp_path):
    want = answers(built_engines, tmp_path / "cpu", "--mode", "colocated", "--device", "cpu")
    assert answers(built_engines, tmp_path / "gpu", "--mode", "colocated", "--device", "cuda") == want


def test_auto_puts_every_local_worker_on_a_visible_gpu():
    gpus = local_gpus(load_deployment(None, {"prefill": {"count": 3}}))
    assert set(gpus) == {"prefill", "decode"} and gpus["prefill"] == gpus["decode"] and gpus["prefill"]
