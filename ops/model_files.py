"""What the front door reads from the engines folder, before any worker starts: the tokenizer (with the
deployment's chat template), the tokens a request may use, and the model's sampling defaults, with its
LoRA adapters checked against the model; and the names it serves the model under. Each failure is a
DeploymentError naming its cause, so a start that cannot succeed ends in one line."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from engine.checkpoint import KNOWN_MODELS
from engine.config import ModelConfig
from engine.hub_cache import is_repo_id, snapshot
from engine.errors import ModelLoadError
from engine.lora_files import check_against
from engine.tokenizer import Tokenizer
from frontdoor.generation_defaults import GenerationConfigError, sampling_defaults
from ops.deployment import Deployment, DeploymentError


@dataclass(frozen=True)
class ModelFiles:
    tokenizer: Tokenizer
    config: ModelConfig
    context: int  # prompt + answer tokens of one request: limits.max_model_len, at most the model's own
    sampling_defaults: dict  # the OpenAI doors' defaults (frontdoor/generation_defaults.py)


def read_model_files(engines: str, dep: Deployment, log=print) -> ModelFiles:
    """The engines folder's files as the deployment reads them (its sampling defaults, if any, logged)."""
    with open(os.path.join(engines, "prefill", "config.json"), encoding="utf-8") as f:
        cfg = ModelConfig.from_hf(json.load(f))
    cap = dep.limits.max_model_len
    if cap is not None and cap > cfg.max_position:
        raise DeploymentError(f"limits.max_model_len {cap} is beyond the model's context of {cfg.max_position} "
                              f"tokens; set at most {cfg.max_position}, or leave it out")
    try:
        defaults = sampling_defaults(dep.front_door.generation_config, engines,
                                     dep.front_door.override_generation_config)
    except GenerationConfigError as e:
        raise DeploymentError(str(e)) from None
    loading = dep.lora_loading
    if loading.root is not None and not os.path.isdir(loading.root):
        raise DeploymentError(f"lora_loading.root {loading.root!r}: no such folder")
    if len(dep.lora_modules) > loading.max_adapters:
        raise DeploymentError(f"lora_modules has {len(dep.lora_modules)} adapters, more than lora_loading.max_adapters "
                              f"({loading.max_adapters}) lets the server hold")
    for name, folder in dep.lora_modules.items():  # their shapes against the model, before a worker loads them
        try:
            check_against(name, folder, cfg)
        except ModelLoadError as e:
            raise DeploymentError(str(e)) from None
    if defaults:
        log(f"sampling defaults from the model's generation config (a request's own values win): "
            f"{', '.join(f'{k}={v}' for k, v in defaults.items())}")
    return ModelFiles(front_door_tokenizer(engines, dep), cfg, cap or cfg.max_position, defaults)


def front_door_tokenizer(engines: str, dep: Deployment) -> Tokenizer:
    """The tokenizer the front door renders chats with, its chat template as the deployment chose."""
    try:
        return Tokenizer(os.path.join(engines, "prefill"), dep.front_door.chat_template)
    except ModelLoadError as e:
        raise DeploymentError(str(e)) from None


def served_names(dep: Deployment, source: str) -> list[str]:
    """The OpenAI model ids, as vLLM's --served-model-name: the deployment's (a name, or a list whose first
    name is the one answers carry, the others aliases a request may use), else the model's own name
    (`source`: smollm2-135m, a Hugging Face repo id found in the cache, or a checkpoint's path: its
    folder's or file's name)."""
    given = dep.front_door.served_model_name
    names = [given] if isinstance(given, str) else list(given or [])
    if not all(names) or len(set(names)) < len(names):
        raise DeploymentError(f"front_door.served_model_name must be distinct non-empty names, got {given!r}")
    if set(names) & set(dep.lora_modules):
        raise DeploymentError(f"lora_modules {sorted(set(names) & set(dep.lora_modules))}: a LoRA adapter may not "
                              f"have a name the model is served under")
    if names:
        return names
    if source in KNOWN_MODELS or (is_repo_id(source) and snapshot(source)):  # a repo id whole, as vLLM's
        return [source]
    return [os.path.basename(os.path.normpath(source)).removesuffix(".gguf")]
