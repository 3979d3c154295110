"""TensorRT-LLM role configs, validated by schema models that mirror TensorRT-LLM's field names.

The LLM-API mirror (LlmApiOptions and its parts) follows `TorchLlmArgs`, `KvCacheConfig`,
`CudaGraphConfig` and `CacheTransceiverConfig` in tensorrt_llm/llmapi/llm_args.py of TensorRT-LLM 1.2.1
(the fields Tandem writes; engine/trtllm/api_surface.json lists them with the source read, and
tests/builder/test_trtllm_repo.py keeps the two in step).

`tensorrt_llm` is never imported here: its wheels are not installable from PyPI, so the configs are
generated and checked against these mirrors everywhere, and only executed where it is installed.
Each model rejects unknown keys, as TensorRT-LLM's own LLM-API argument models do.

- LlmApiOptions: the YAML given to `trtllm-serve MODEL --config FILE` (PyTorch backend) per role.
  Our "prefill"/"decode" become TensorRT-LLM's context/generation servers here and nowhere else.
- DisaggConfig: the file for `trtllm-serve disaggregated -c FILE`.
- TrtllmBuildArgs / ConvertCheckpointArgs: the legacy TensorRT-engine path (removed from
  TensorRT-LLM in 2026; needs a release that still ships `trtllm-build`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KvCacheConfig(_Strict):
    tokens_per_block: int = Field(32, ge=1)
    free_gpu_memory_fraction: float | None = Field(0.9, gt=0, le=1)
    enable_block_reuse: bool = True
    dtype: str = "auto"


class CudaGraphConfig(_Strict):
    batch_sizes: list[int] | None = None
    max_batch_size: int = Field(0, ge=0)
    enable_padding: bool = False

    @model_validator(mode="after")
    def _consistent(self):
        if self.batch_sizes and self.max_batch_size and self.max_batch_size != max(self.batch_sizes):
            raise ValueError(f"cuda_graph_config.max_batch_size ({self.max_batch_size}) must equal "
                             f"max(batch_sizes) ({max(self.batch_sizes)})")
        return self


class CacheTransceiverConfig(_Strict):
    backend: Literal["DEFAULT", "UCX", "NIXL", "MPI", "MOONCAKE"] | None = None
    max_tokens_in_buffer: int | None = Field(None, ge=1)
    kv_transfer_timeout_ms: int | None = Field(None, ge=1)  # a pull not done by then is cancelled


class LlmApiOptions(_Strict):
    max_batch_size: int = Field(ge=1)
    max_num_tokens: int = Field(ge=1)
    max_seq_len: int | None = Field(None, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    enable_chunked_prefill: bool = False
    disable_overlap_scheduler: bool = False
    print_iter_log: bool = False
    kv_cache_config: KvCacheConfig = KvCacheConfig()
    cuda_graph_config: CudaGraphConfig | None = None
    cache_transceiver_config: CacheTransceiverConfig | None = None


def load_role_options(path: str) -> dict:
    """The LLM-API options of a role YAML, checked by the mirror (unknown keys refused), as plain data."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a role YAML is a mapping of LLM-API options, got {type(data).__name__}")
    return LlmApiOptions(**data).model_dump(exclude_none=True)


class DisaggServers(_Strict):
    num_instances: int = Field(1, ge=1)
    urls: list[str]

    @model_validator(mode="after")
    def _count(self):
        if len(self.urls) != self.num_instances:
            raise ValueError(f"{self.num_instances} instances but {len(self.urls)} urls")
        return self


class DisaggConfig(_Strict):
    hostname: str = "localhost"
    port: int = Field(8000, ge=1, le=65535)
    backend: Literal["pytorch"] = "pytorch"
    context_servers: DisaggServers
    generation_servers: DisaggServers


class ConvertCheckpointArgs(_Strict):
    model_dir: str
    output_dir: str
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    use_weight_only: bool = False
    weight_only_precision: Literal["int8", "int4"] = "int8"

    def argv(self) -> list[str]:
        out = ["python", "convert_checkpoint.py", "--model_dir", self.model_dir, "--output_dir", self.output_dir,
               "--dtype", self.dtype]
        return out + (["--use_weight_only", "--weight_only_precision", self.weight_only_precision]
                      if self.use_weight_only else [])


class TrtllmBuildArgs(_Strict):
    checkpoint_dir: str
    output_dir: str
    max_batch_size: int = Field(ge=1)
    max_num_tokens: int = Field(ge=1)
    max_input_len: int = Field(ge=1)
    max_seq_len: int = Field(ge=1)
    kv_cache_type: Literal["paged", "continuous", "disabled"] = "paged"
    tokens_per_block: int = Field(32, ge=1)
    gemm_plugin: str = "auto"
    gpt_attention_plugin: str = "auto"
    remove_input_padding: Literal["enable", "disable"] = "enable"
    context_fmha: Literal["enable", "disable"] = "enable"
    use_paged_context_fmha: Literal["enable", "disable"] = "enable"

    def argv(self) -> list[str]:
        out = ["trtllm-build"]
        for name, value in self.model_dump().items():
            out += [f"--{name}", str(value)]
        return out
