"""`tandem repo --backend tensorrt-llm`: a 2P2D Triton repository whose every config.pbtxt parses with
Triton's ModelConfig proto and whose role YAMLs validate against the LLM-API schema mirror."""

from __future__ import annotations

import os

import pytest
import yaml
from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from builder.build import BuildRequest
from builder.repo import RenderError
from engine.trtllm.llm_options import CacheTransceiverConfig, CudaGraphConfig, KvCacheConfig, LlmApiOptions, load_role_options
from builder.trtllm_build import build_trtllm
from builder.trtllm_repo import render_trtllm_repo, role_files, worker_plan
from cli.main import main
from engine.trtllm.surface import surface


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    out = tmp_path_factory.mktemp("trt") / "engines"
    build_trtllm(BuildRequest(model="smollm2-135m", out=str(out)), dry_run=False, log=lambda *_: None)
    return out


def _config(path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_2p2d_repository_parses_with_tritons_model_config(engines, tmp_path):
    repo = tmp_path / "repo"
    workers = render_trtllm_repo(str(engines), str(repo), prefill_workers=2, decode_workers=2)
    assert workers == ["prefill_0", "prefill_1", "decode_0", "decode_1"]
    assert sorted(os.listdir(repo)) == sorted(workers)
    gpus = []
    for worker in workers:
        role = worker.split("_")[0]
        assert os.listdir(repo / worker) == [role]  # one model per worker's repository, named by its role
        cfg = _config(repo / worker / role / "config.pbtxt")
        params = {k: v.string_value for k, v in cfg.parameters.items()}
        assert cfg.name == role and cfg.backend == "python" and cfg.model_transaction_policy.decoupled
        assert [g.kind for g in cfg.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
        assert list(cfg.instance_group[0].gpus) == [int(params["gpu_ids"].split(",")[0])]
        assert params["role"] == role and params["llm_yaml"] == str(engines / role / "llm_api_options.yaml")
        assert os.path.isfile(os.path.join(params["model_dir"], "config.json"))
        LlmApiOptions(**yaml.safe_load(open(params["llm_yaml"])))  # the mirror accepts what the model reads
        assert (repo / worker / role / "1" / "model.py").read_text().count("engine.triton.trtllm_model") == 1
        gpus.append(params["gpu_ids"])
    assert gpus == ["0", "1", "2", "3"]


def test_cpu_instances_for_the_test_double_parse_and_name_no_gpu(engines, tmp_path):
    """on_gpu=False (only tests/trtllm's double of tensorrt_llm runs so): KIND_CPU, no GPU list."""
    repo = tmp_path / "repo"
    render_trtllm_repo(str(engines), str(repo), prefill_workers=1, decode_workers=1, on_gpu=False)
    for worker, role in (("prefill_0", "prefill"), ("decode_0", "decode")):
        cfg = _config(repo / worker / role / "config.pbtxt")
        assert [(g.kind, list(g.gpus)) for g in cfg.instance_group] == [
            (model_config_pb2.ModelInstanceGroup.KIND_CPU, [])]


def test_gpu_assignment_keeps_tensor_parallel_engines_on_one_node(engines):
    files = role_files(str(engines))
    files = {r: (folder, {**opts, "tensor_parallel_size": 2 if r.value == "decode" else 1})
             for r, (folder, opts) in files.items()}
    plan = worker_plan(files, prefill_workers=3, decode_workers=2, gpus_per_node=4)
    assert [p["gpu_ids"] for p in plan] == ["0", "1", "2", "0,1", "2,3"]  # decode_0 starts the next node
    with pytest.raises(RenderError, match="need 2 GPUs"):
        worker_plan(files, 1, 1, gpus_per_node=1)


def test_role_yamls_that_cannot_pull_from_each_other_are_refused(engines, tmp_path):
    bad = tmp_path / "bad"
    os.system(f"cp -r {engines} {bad}")
    decode_yaml = bad / "decode" / "llm_api_options.yaml"
    data = yaml.safe_load(decode_yaml.read_text())
    data["cache_transceiver_config"]["backend"] = "UCX"
    decode_yaml.write_text(yaml.safe_dump(data))
    with pytest.raises(RenderError, match="cache_transceiver_config.backend"):
        render_trtllm_repo(str(bad), str(tmp_path / "repo"))
    data["cache_transceiver_config"]["backend"] = "NIXL"
    data["use_cuda_grap"] = True  # a typo TensorRT-LLM's own argument models would refuse
    decode_yaml.write_text(yaml.safe_dump(data))
    with pytest.raises(RenderError, match="use_cuda_grap"):
        render_trtllm_repo(str(bad), str(tmp_path / "repo"))
    with pytest.raises(RenderError, match="tandem build --backend tensorrt-llm"):
        render_trtllm_repo(str(tmp_path / "nothing"), str(tmp_path / "repo"))
    assert not (tmp_path / "repo").exists()


def test_schema_mirror_and_recorded_surface_name_the_same_fields():
    recorded = surface()["llm_args_fields"]
    assert set(LlmApiOptions.model_fields) == set(recorded["top"])
    assert set(KvCacheConfig.model_fields) == set(recorded["kv_cache_config"])
    assert set(CudaGraphConfig.model_fields) == set(recorded["cuda_graph_config"])
    assert set(CacheTransceiverConfig.model_fields) == set(recorded["cache_transceiver_config"])


def test_repo_command_renders_xpyd(engines, tmp_path):
    result = CliRunner().invoke(main, ["repo", "--backend", "tensorrt-llm", "--engines", str(engines), "--out",
                                       str(tmp_path / "r"), "--prefill-workers", "1", "--decode-workers", "3"])
    assert result.exit_code == 0, result.output
    assert "prefill_0, decode_0, decode_1, decode_2" in result.output
    opts = load_role_options(str(engines / "prefill" / "llm_api_options.yaml"))
    assert opts["disable_overlap_scheduler"] is True
