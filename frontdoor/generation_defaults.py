"""The model creator's sampling defaults (a checkpoint's generation_config.json), applied as vLLM applies them.

`tandem serve --generation-config` (`front_door.generation_config`) says where they come from: `auto`
(the default) reads the engines' generation_config.json (the build copies it from a Hugging Face
checkpoint; a GGUF file carries none, so the default model has none), a path reads that file or that
folder's generation_config.json, `none` reads nothing. `--override-generation-config '{"temperature":
0.5}'` (`front_door.override_generation_config`) sets fields on top, as vLLM's flag does (with `none`:
only those), in the file's names; an override is never skipped, so `{"temperature": 1.0}` undoes a
model's own temperature.

The fields vLLM reads are the defaults of the OpenAI doors' requests (completions, chat, Responses)
where a request leaves them out or sends null: `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens`, the most tokens an answer gets when its `max_tokens` is
left out (within the context; without it, 1024). A request's own value always wins. A value equal to
transformers' own default (temperature 1.0, top_p 1.0, top_k 50, repetition_penalty 1.0) is no choice
of the model's creator and is skipped, as vLLM skips it; `do_sample` is not read (vLLM reads it
neither). The KServe and gRPC doors keep TensorRT-LLM's tensor contract, whose inputs have their own
defaults.
"""

from __future__ import annotations

import os

from tandem.json_object import read_json_object
from tandem.sampling_params import SamplingParams
from tandem.status import InvalidArgument

FILE = "generation_config.json"
# generation_config.json key -> the request field it is the default of
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_TRANSFORMERS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}  # not a choice


class GenerationConfigError(ValueError):
    """The generation config named cannot be read, or holds a value no request could have."""


def sampling_defaults(choice: str, engines: str, overrides: dict | None = None) -> dict[str, float | int]:
    """The request fields' defaults (`_FIELDS`' values as keys) that `choice` (auto, none, or a path)
    gives for the engines folder `engines`, with `overrides` (the file's names) on top; {} where none."""
    unknown = sorted(set(overrides or {}) - set(_FIELDS))
    if unknown:
        raise GenerationConfigError(f"override_generation_config: unknown field(s) {unknown}; allowed: "
                                    f"{', '.join(_FIELDS)}")
    return _checked(_read(choice, engines) | {_FIELDS[k]: v for k, v in (overrides or {}).items()},
                    "override_generation_config")


def _read(choice: str, engines: str) -> dict:
    """The defaults the file that `choice` names holds, transformers' own skipped."""
    if choice == "none":
        return {}
    path = os.path.join(engines, "prefill") if choice == "auto" else choice
    if os.path.isdir(path):
        path = os.path.join(path, FILE)
    if not os.path.isfile(path):
        if choice == "auto":
            return {}
        raise GenerationConfigError(f"generation config {choice}: no such file, nor a folder holding {FILE} "
                                    f"(use auto, none, or a path)")
    try:
        data = read_json_object(path)
    except ValueError as e:
        raise GenerationConfigError(f"the generation config: {e}") from None
    return _checked({field: data[key] for key, field in _FIELDS.items()
                     if data.get(key) is not None and data[key] != _TRANSFORMERS.get(key)}, path)


def _checked(defaults: dict, source: str) -> dict:
    """`defaults`, if every request could have them (GenerationConfigError naming `source` otherwise)."""
    try:
        SamplingParams(**defaults)  # the ranges every request's values must be in
    except (InvalidArgument, TypeError) as e:
        raise GenerationConfigError(f"{source}: {e}") from None
    return defaults
