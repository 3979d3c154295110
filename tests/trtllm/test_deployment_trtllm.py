"""`backend: tensorrt-llm` in a deployment: the combinations its role engines cannot serve are refused
with the field and what is allowed; the ones they can get TensorRT-LLM's handoff."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli.main import main
from ops.deployment import DeploymentError, load_deployment
from ops.trtllm_stack import TrtllmEngines, trtllm_engines, trtllm_gpus_per_node

REMOTE = {"prefill.count": 0, "prefill.urls": ["127.0.0.1:9001"], "decode.count": 0,
          "decode.urls": ["127.0.0.1:9002"]}


def deployment(**overrides):
    return load_deployment(None, {"backend": "tensorrt-llm", **overrides})


@pytest.mark.parametrize("overrides, says", [
    ({"mode": "colocated"}, "disaggregated mode only"),
    ({"handoff.mode": "push"}, "set handoff.mode: pull or leave it out"),
    ({"transport": "shm"}, "leave transport out"),
    ({"local_prefill_tokens": 64}, "local_prefill_tokens must be 0"),
    ({"prefix_cache.per_api_key": True}, "leave prefix_cache.per_api_key off"),
    ({"lora_loading.root": "/tmp"}, "leave lora_modules and lora_loading.root out"),
    ({"max_num_seqs": 8}, "leave max_num_seqs and max_num_batched_tokens out"),
    ({"device": "cpu"}, "runs on CUDA"),
    ({"decode.device": "cpu", "device": "cuda"}, "decode has local workers with device cpu"),
    ({"prefill.gpus": [0], "device": "cuda"}, "leave prefill.gpus out"),
    ({"backend": "tensorrt"}, "backend"),
])
def test_combinations_its_engines_cannot_serve_are_refused(overrides, says):
    with pytest.raises(DeploymentError, match=says):
        deployment(**overrides)


def test_pull_is_implied_and_the_serving_path_uses_the_trtllm_handoff():
    assert deployment(device="cuda").handoff_mode == "trtllm"
    assert deployment(**{"handoff.mode": "pull", "device": "cuda"}).handoff_mode == "trtllm"
    assert deployment(device="cpu", **REMOTE).handoff_mode == "trtllm"  # workers elsewhere: their device
    assert load_deployment(None, {"handoff.mode": "pull"}).handoff_mode == "pull"  # torch: the deployment's


def test_local_workers_need_a_gpu_per_engine_gpu():
    one_each = TrtllmEngines("e", 16, "m", {"prefill": 1, "decode": 1})
    with pytest.raises(DeploymentError, match="no CUDA device is visible"):
        trtllm_gpus_per_node(deployment(), {}, one_each)
    assert trtllm_gpus_per_node(deployment(**REMOTE), {}, one_each) == 0
    two = {"prefill": (0, 1), "decode": (0, 1)}
    assert trtllm_gpus_per_node(deployment(device="cuda"), two, one_each) == 2
    with pytest.raises(DeploymentError, match="need 4 GPUs .* and 2 are visible"):
        trtllm_gpus_per_node(deployment(device="cuda", **{"decode.count": 3}), two, one_each)
    with pytest.raises(DeploymentError, match="need 3 GPUs"):
        trtllm_gpus_per_node(deployment(device="cuda"), two, TrtllmEngines("e", 16, "m", {"prefill": 1, "decode": 2}))


def test_an_engines_folder_without_role_yamls_is_refused(tmp_path):
    (tmp_path / "prefill").mkdir()
    with pytest.raises(DeploymentError, match="tandem build --backend tensorrt-llm"):
        trtllm_engines(deployment(engines=str(tmp_path), **REMOTE))


def test_serve_refuses_backend_tensorrt_llm_on_the_cpu_in_one_line():
    result = CliRunner().invoke(main, ["serve", "--backend", "tensorrt-llm", "--device", "cpu"])
    assert result.exit_code != 0
    assert "backend tensorrt-llm runs on CUDA" in result.output
