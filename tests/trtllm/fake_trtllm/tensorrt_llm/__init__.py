"""NOT TensorRT-LLM: a test double of the part of its LLM API that Tandem's adapter uses
(engine/trtllm/api_surface.json, TensorRT-LLM 1.2.1), running Tandem's own PyTorch engine and model.

Only tests use it: they copy this package beside the model.py of the Triton workers they start (the
Python stub imports from there and ignores PYTHONPATH), so that engine/triton/trtllm_model.py and engine/trtllm/adapter.py run unchanged, through Triton and
Tandem's orchestrator, on a machine without TensorRT-LLM or a GPU. Nothing it shows is a TensorRT-LLM
result: real TensorRT-LLM has not run on this project's machines (tests/trtllm/test_real.py is the
real test, skipped there).

What it implements, and nothing more: `LLM(model=..., backend="pytorch", **options)` with
`generate_async(ids, SamplingParams, streaming=, disaggregated_params=)` returning a RequestOutput
(`aresult()`, async iteration, `abort()`, `finished`, `outputs[0].token_ids/.logprobs/.finish_reason/
.disaggregated_params`) and `shutdown()`; `SamplingParams` with the recorded fields;
`disaggregated_params.DisaggregatedParams` and `DisaggScheduleStyle`;
`llmapi.llm_utils.update_llm_args_with_extra_dict`; `executor.utils.RequestError`; `__version__`.
How it serves requests and hands a context over: tensorrt_llm/_fake_engine.py.
"""

from dataclasses import dataclass

from tensorrt_llm._fake_engine import LLM  # noqa: F401

__version__ = "1.2.1"


@dataclass
class SamplingParams:
    """The fields Tandem sets (api_surface.json: sampling_params.fields_used), TensorRT-LLM's defaults."""

    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    logprobs: int | None = None
    detokenize: bool = True
