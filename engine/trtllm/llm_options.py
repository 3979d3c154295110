"""TensorRT-LLM's LLM-API options per role, validated by schema models that mirror its field names.

The mirror (LlmApiOptions and its parts) follows `TorchLlmArgs`, `KvCacheConfig`, `CudaGraphConfig` and
`CacheTransceiverConfig` in tensorrt_llm/llmapi/llm_args.py of TensorRT-LLM 1.2.1 (the fields Tandem
writes; engine/trtllm/api_surface.json lists them with the source read, and
tests/builder/test_trtllm_repo.py keeps the two in step). builder/trtllm_build.py writes a role's YAML
from them; engine/trtllm/adapter.py loads it back (load_role_options) in the worker. `tensorrt_llm` is
never imported here. Each model rejects unknown keys, as TensorRT-LLM's own argument models do.
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
