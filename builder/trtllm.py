"""TensorRT-LLM role configs, validated by schema models that mirror TensorRT-LLM's field names.

`tensorrt_llm` is never imported here: its wheels are not installable from PyPI, so the configs are
generated and checked against these mirrors everywhere, and only executed where it is installed.
Each model rejects unknown keys, as TensorRT-LLM's own LLM-API argument models do.

- LlmApiOptions (engine/trtllm/llm_options.py, beside the worker that loads it): the YAML given to
  `trtllm-serve MODEL --config FILE` (PyTorch backend) per role. Our "prefill"/"decode" become
  TensorRT-LLM's context/generation servers in the builder and nowhere else.
- DisaggConfig: the file for `trtllm-serve disaggregated -c FILE`.
- TrtllmBuildArgs / ConvertCheckpointArgs: the legacy TensorRT-engine path (removed from
  TensorRT-LLM in 2026; needs a release that still ships `trtllm-build`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
