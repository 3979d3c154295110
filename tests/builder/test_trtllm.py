"""TensorRT-LLM configs: schema mirrors reject what TensorRT-LLM would, and the build writes valid files."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from builder.build import BuildRequest
from builder.trtllm import DisaggConfig
from builder.trtllm_build import build_trtllm
from engine.trtllm.llm_options import CudaGraphConfig, LlmApiOptions


def test_unknown_keys_and_inconsistent_values_are_rejected():
    with pytest.raises(ValidationError, match="use_cuda_grap"):
        LlmApiOptions(max_batch_size=8, max_num_tokens=8192, use_cuda_grap=True)
    with pytest.raises(ValidationError, match="must equal max\\(batch_sizes\\)"):
        CudaGraphConfig(batch_sizes=[1, 2, 4], max_batch_size=8)
    with pytest.raises(ValidationError, match="2 instances but 1 urls"):
        DisaggConfig(context_servers={"num_instances": 2, "urls": ["a:1"]}, generation_servers={"urls": ["b:2"]})
    with pytest.raises(ValidationError, match="cache_transceiver_config.backend"):
        LlmApiOptions(max_batch_size=1, max_num_tokens=1, cache_transceiver_config={"backend": "TCP"})


def test_build_writes_role_configs_that_parse_back(tmp_path):
    out = tmp_path / "trt"
    lines = []
    build_trtllm(BuildRequest(model="smollm2-135m", out=str(out), weight_quant="int8"), dry_run=False, log=lines.append)
    ctx = LlmApiOptions(**yaml.safe_load((out / "prefill" / "llm_api_options.yaml").read_text()))
    gen = LlmApiOptions(**yaml.safe_load((out / "decode" / "llm_api_options.yaml").read_text()))
    assert ctx.disable_overlap_scheduler and ctx.cuda_graph_config is None and ctx.max_num_tokens == 8192
    assert gen.cuda_graph_config.batch_sizes[-1] == gen.max_batch_size == 256 and gen.max_num_tokens == 256
    assert ctx.cache_transceiver_config.backend == gen.cache_transceiver_config.backend == "NIXL"
    assert ctx.kv_cache_config.tokens_per_block == gen.kv_cache_config.tokens_per_block == 16
    DisaggConfig(**yaml.safe_load((out / "disagg_config.yaml").read_text()))
    assert (out / "decode" / "config.json").exists()
    legacy = (out / "trtllm_build_legacy.sh").read_text()
    assert "--use_weight_only --weight_only_precision int8" in legacy
    assert sum(line.startswith("trtllm-build ") for line in legacy.splitlines()) == 2
    assert any("not executed: tensorrt_llm is not installed" in line for line in lines)


def test_dry_run_prints_and_writes_nothing(tmp_path):
    lines = []
    build_trtllm(BuildRequest(model="smollm2-135m", out=str(tmp_path / "t")), dry_run=True, log=lines.append)
    assert not (tmp_path / "t").exists()
    assert any("would write" in line and "llm_api_options.yaml" in line for line in lines)
