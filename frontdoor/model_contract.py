"""The LLM model the front doors serve, with the tensor contract of TensorRT-LLM's Triton `ensemble`.

Existing Triton LLM clients (and genai-perf / perf_analyzer) send `text_input` and `max_tokens` plus
optional sampling inputs, shaped [batch, 1] because the model has a batch dimension. Streamed
responses carry only the new text in `text_output`. Inputs we accept only at their neutral value
(e.g. beam_width 1, length_penalty 1) are refused otherwise, with the reason; the repetition, presence
and frequency penalties, `bad_words`, guided decoding and `cache_salt` are honoured (the same rules as the OpenAI
door's; a bad word is tokenized as it is sent, as TensorRT-LLM's preprocessing does). `lora_name`
(Tandem's own input) names a LoRA adapter the server serves, as an OpenAI request's `model` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from control.requests import GenerationRequest
from frontdoor.schedule_policy import PriorityLevels, advertise
from tandem.guides import Guide, GuideKind
from tandem.status import InvalidArgument

MAX_BATCH_SIZE = 64


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = True


INPUTS = (
    TensorSpec("text_input", "BYTES", (1,), optional=False),
    TensorSpec("max_tokens", "INT32", (1,), optional=False),
    TensorSpec("stream", "BOOL", (1,)),
    TensorSpec("exclude_input_in_output", "BOOL", (1,)),
    TensorSpec("temperature", "FP32", (1,)),
    TensorSpec("top_k", "INT32", (1,)),
    TensorSpec("top_p", "FP32", (1,)),
    TensorSpec("seed", "UINT64", (1,)),
    TensorSpec("random_seed", "UINT64", (1,)),  # the name before TensorRT-LLM's 2025 rename to `seed`
    TensorSpec("min_tokens", "INT32", (1,)),
    TensorSpec("min_length", "INT32", (1,)),  # the name genai-perf sends for a deterministic output length
    TensorSpec("stop_words", "BYTES", (-1,)),
    TensorSpec("bad_words", "BYTES", (-1,)),
    TensorSpec("end_id", "INT32", (1,)),
    TensorSpec("pad_id", "INT32", (1,)),
    TensorSpec("return_log_probs", "BOOL", (1,)),
    TensorSpec("beam_width", "INT32", (1,)),
    TensorSpec("num_return_sequences", "INT32", (1,)),
    TensorSpec("repetition_penalty", "FP32", (1,)),
    TensorSpec("presence_penalty", "FP32", (1,)),
    TensorSpec("frequency_penalty", "FP32", (1,)),
    TensorSpec("length_penalty", "FP32", (1,)),
    TensorSpec("return_context_logits", "BOOL", (1,)),
    TensorSpec("return_generation_logits", "BOOL", (1,)),
    TensorSpec("guided_decoding_guide_type", "BYTES", (1,)),  # json, json_schema, regex, ebnf_grammar (choice)
    TensorSpec("guided_decoding_guide", "BYTES", (1,)),  # the schema, regex or grammar (tandem/guides.py)
    TensorSpec("cache_salt", "BYTES", (1,)),  # cached prefix pages are shared only under the same salt (vLLM's)
    TensorSpec("lora_name", "BYTES", (1,)),  # a LoRA adapter the server serves (--lora-modules); empty: the base
)
OUTPUTS = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("output_log_probs", "FP32", (-1,)),
    TensorSpec("cum_log_probs", "FP32", (-1,)),
    TensorSpec("num_input_tokens", "INT32", (1,)),
    TensorSpec("num_output_tokens", "INT32", (1,)),
)
_BY_NAME = {t.name: t for t in INPUTS}
_TYPE = {"BYTES": mc.TYPE_STRING, "INT32": mc.TYPE_INT32, "UINT64": mc.TYPE_UINT64, "FP32": mc.TYPE_FP32,
         "BOOL": mc.TYPE_BOOL}


def model_config(name: str, levels: PriorityLevels | None = None) -> mc.ModelConfig:
    """The served model's Triton config; `levels`: the priority levels the server honours (None: none)."""
    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=MAX_BATCH_SIZE)
    cfg.model_transaction_policy.decoupled = True
    for t in INPUTS:
        cfg.input.add(name=t.name, data_type=_TYPE[t.datatype], dims=list(t.dims), optional=t.optional)
    for t in OUTPUTS:
        cfg.output.add(name=t.name, data_type=_TYPE[t.datatype], dims=list(t.dims))
    if levels is not None:
        advertise(cfg.dynamic_batching, levels)
    return cfg


# inputs we take only at the value that means "off"
_NEUTRAL = {"beam_width": 1, "num_return_sequences": 1, "length_penalty": 1.0, "return_context_logits": False,
            "return_generation_logits": False}


def _rows(name: str, arr: np.ndarray, batch: int) -> list:
    """One value (or list for [-1] inputs) per batch row of an input shaped [batch, ...]."""
    spec = _BY_NAME[name]
    if arr.ndim == 0 or arr.shape[0] != batch:
        raise InvalidArgument(f"input {name!r} has shape {list(arr.shape)}; expected [{batch}, ...] like text_input")
    if spec.dims == (1,) and int(np.prod(arr.shape[1:])) != 1:
        raise InvalidArgument(f"input {name!r} must hold one value per request, got shape {list(arr.shape)}")
    return [row.tolist() if spec.dims == (-1,) else row.tolist()[0] for row in arr.reshape(batch, -1)]


def check_types(inputs: dict[str, tuple[str, np.ndarray]]) -> None:
    for name, (datatype, _) in inputs.items():
        spec = _BY_NAME.get(name)
        if spec is None:
            raise InvalidArgument(f"unknown input {name!r}; this model takes {', '.join(_BY_NAME)}")
        if datatype != spec.datatype:
            raise InvalidArgument(f"input {name!r} must be {spec.datatype}, got {datatype}")
    for spec in INPUTS:
        if not spec.optional and spec.name not in inputs:
            raise InvalidArgument(f"missing required input {spec.name!r} ({spec.datatype}, shape [batch, 1])")


def parse_requests(inputs: dict[str, tuple[str, np.ndarray]], request_id: str) -> tuple[list[GenerationRequest], bool]:
    """Turn decoded input tensors into one GenerationRequest per batch row, and the stream flag."""
    check_types(inputs)
    text = inputs["text_input"][1]
    batch = text.shape[0] if text.ndim >= 1 else 1
    if batch < 1 or batch > MAX_BATCH_SIZE:
        raise InvalidArgument(f"batch size must be 1..{MAX_BATCH_SIZE}, got {batch}")
    cols = {name: _rows(name, arr if arr.ndim else arr.reshape(1), batch) for name, (_, arr) in inputs.items()}
    stream = bool(cols.get("stream", [False])[0])
    if stream and batch != 1:
        raise InvalidArgument(f"streaming takes one prompt per request (batch 1), got batch {batch}")
    out = []
    for i in range(batch):
        row = {name: vals[i] for name, vals in cols.items()}
        for name, neutral in _NEUTRAL.items():
            if name in row and row[name] != neutral:
                raise InvalidArgument(f"{name}={row[name]!r} is not supported; only {neutral!r}")
        prompt = _text(row, "text_input")
        seed = row.get("seed", row.get("random_seed"))
        out.append(GenerationRequest(
            request_id=f"{request_id}-{i}" if batch > 1 else request_id, prompt=prompt,
            max_tokens=row["max_tokens"], temperature=row.get("temperature", 0.0), top_k=row.get("top_k", 0),
            top_p=row.get("top_p", 1.0), seed=int(seed) if seed is not None else None,
            min_tokens=row.get("min_tokens", row.get("min_length", 0)),
            stop=_words(row, "stop_words"), bad_words=_words(row, "bad_words"),
            end_id=row.get("end_id"), logprobs=bool(row.get("return_log_probs", False)),
            repetition_penalty=row.get("repetition_penalty", 1.0),
            presence_penalty=row.get("presence_penalty", 0.0), frequency_penalty=row.get("frequency_penalty", 0.0),
            exclude_input=bool(row.get("exclude_input_in_output", False)) or stream, guide=_guide(row),
            cache_salt=_text(row, "cache_salt"), model=_text(row, "lora_name") or None))
    return out, stream


def _words(row: dict, name: str) -> tuple[str, ...]:
    """A [-1] BYTES input of words (stop_words, bad_words), empty entries left out."""
    return tuple(w.decode("utf-8", "replace") if isinstance(w, bytes) else str(w) for w in row.get(name, []) if w)


def _text(row: dict, name: str) -> str:
    raw = row.get(name, b"")
    try:
        return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError:
        raise InvalidArgument(f"{name} is not valid UTF-8", name) from None


def _guide(row: dict) -> Guide | None:
    """TensorRT-LLM's guided-decoding inputs: a type (absent or empty: none) and the guide's text."""
    kind, text = _text(row, "guided_decoding_guide_type"), _text(row, "guided_decoding_guide")
    if not kind:
        if text:
            raise InvalidArgument("guided_decoding_guide needs guided_decoding_guide_type (json, json_schema, regex, "
                                  "ebnf_grammar or choice)", "guided_decoding_guide_type")
        return None
    if kind not in {k.value for k in GuideKind}:
        raise InvalidArgument(f"guided_decoding_guide_type must be one of {', '.join(k.value for k in GuideKind)}, "
                              f"got {kind!r}", "guided_decoding_guide_type")
    return Guide(GuideKind(kind), text)
