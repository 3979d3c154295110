"""Shared fixtures: the real default model, loaded once per session, and leak checks."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_engine():
    """The default model (SmolLM2-135M-Instruct, fp32) with a 256 MiB local KV pool."""
    from engine.load import load_engine

    return load_engine("smollm2-135m", kv_bytes=256 << 20)


@pytest.fixture(scope="session")
def hf_default_model():
    """Hugging Face transformers' own load of the same GGUF: the exactness reference."""
    import importlib.util

    transformers = pytest.importorskip("transformers")
    from engine.checkpoint import KNOWN_MODELS

    package, filename, _ = KNOWN_MODELS["smollm2-135m"]
    folder = list(importlib.util.find_spec(package).submodule_search_locations)[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="session")
def built_engines(tmp_path_factory):
    """Prefill and decode engines of the default model, built once per session: engines/<name>/{prefill,decode}."""
    from builder.build import BuildRequest, build

    out = tmp_path_factory.mktemp("engines") / "smollm2"
    build(BuildRequest(model="smollm2-135m", out=str(out)), log=lambda *_: None)
    return out


def leak_check() -> list[str]:
    """What a finished lifecycle test must not leave: our shm segments, tritonserver processes."""
    import subprocess

    from engine.shm import our_segments

    problems = [f"shared memory segment {s}" for s in our_segments()]
    problems += [f"Triton shared memory {n}" for n in os.listdir("/dev/shm") if n.startswith("triton_python_backend")]
    ps = subprocess.run(["pgrep", "-f", "tritonserver|triton_python_backend_stub"], capture_output=True, text=True)
    problems += [f"process {pid}" for pid in ps.stdout.split()]
    return problems


@pytest.fixture(scope="session")
def rendered_repo(built_engines, tmp_path_factory):
    """The Triton model repository for the session's engines (shm transport, 128 MiB decode pool)."""
    from builder.repo import RepoOptions, render_repo

    out = tmp_path_factory.mktemp("repo") / "models"
    render_repo(str(built_engines), str(out), RepoOptions(kv_pool_bytes=128 << 20))
    return out
