"""Build an Engine from whatever the user named: a model name, a GGUF, an HF folder or a role engine.

A role engine folder (one with manifest.json, written by `tandem build`) fixes dtype, weight
quantization and KV page size itself, and its weights are checked against the manifest's digest.
"""

from __future__ import annotations

import os

import torch

from engine.checkpoint import resolve
from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.kv_pool import TORCH_DTYPES, KVCache
from engine.lora import load_adapter
from engine.model import LlamaModel
from engine.tokenizer import Tokenizer
from tandem.kv_layout import KVLayout
from tandem.digest import sha256_files
from tandem.manifest import MANIFEST_FILE, EngineManifest, ManifestError, read_manifest
from tandem.profiles import DECODE

DEFAULT_KV_BYTES = 1 << 30  # 1 GiB of KV pages unless told otherwise
DEFAULT_TOKENS_PER_PAGE = 16


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not supported; allowed: auto, {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def engine_manifest(model: str) -> EngineManifest | None:
    """The manifest when `model` is a role engine folder, else None."""
    if not os.path.isfile(os.path.join(model, MANIFEST_FILE)):
        return None
    try:
        return read_manifest(model)
    except ManifestError as e:
        raise ModelLoadError(str(e)) from None


def verify_weights(folder: str, m: EngineManifest) -> None:
    paths = [os.path.join(folder, f) for f in m.weight_files]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ModelLoadError(f"engine {folder} lacks weight files {missing}; rebuild it with 'tandem build'")
    if sha256_files(paths, desc="verify") != m.weights_digest:
        raise ModelLoadError(f"weights in {folder} do not match the manifest digest (corrupted or modified); "
                             f"rebuild the engine with 'tandem build --force'")


def load_engine(model: str, *, dtype: str = "auto", device: str = "cpu",
                tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE, kv_bytes: int | None = DEFAULT_KV_BYTES,
                shared_kv: bool = False, weight_quant: str = "none", prefix_cache: bool = True,
                cuda_graphs: bool | str = "auto", lora_modules: dict[str, str] | None = None) -> Engine:
    """Load weights and tokenizer, and allocate a KV pool of `kv_bytes` (None: no pool, prefill-only)
    on `device` (weights and pool alike: on "cuda" the pool is GPU memory).

    `dtype` "auto": a role engine's own dtype (its manifest), else bfloat16 on CUDA and float32 on
    CPU; float32 is the exactness reference on either. `prefix_cache` False: the pool keeps no page
    after its request (see engine/prefix_cache.py). `cuda_graphs` (True, False, "auto" = on for a
    CUDA engine with a pool): decode steps replay graphs captured at the padded batch sizes of the
    role profile (a decode engine's manifest, else the default decode profile); see
    engine/cuda_graphs.py. `lora_modules`: LoRA adapters by name (folder), which requests may name
    (engine/lora.py; decode steps with an adapter's rows stay off the graphs).
    """
    manifest = engine_manifest(model)
    graph_sizes = DECODE.cuda_graph_batch_sizes
    if manifest is not None:
        if manifest.backend != "torch":
            raise ModelLoadError(f"{model} is a {manifest.backend} engine; the PyTorch engine runs 'torch' builds")
        verify_weights(model, manifest)
        dtype, tokens_per_page = manifest.dtype, manifest.kv_layout.tokens_per_page
        weight_quant = manifest.profile.weight_quant
        graph_sizes = manifest.profile.cuda_graph_batch_sizes or graph_sizes
    ckpt = resolve(model)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' asked for but no CUDA device is visible; use --device cpu")
    dtype = _resolve_dtype(dtype, dev)
    tdt = torch_dtype(dtype)
    graphs = _want_graphs(cuda_graphs, dev, kv_bytes)
    lm = LlamaModel(ckpt.config, ckpt.load_weights(), dev, tdt, weight_quant)
    for name, folder in (lora_modules or {}).items():
        lm.loras[name] = load_adapter(name, folder, ckpt.config, dev, tdt)
    tokenizer = Tokenizer(ckpt.folder)
    cache = None
    if kv_bytes is not None:
        c = ckpt.config
        layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, dtype, tokens_per_page)
        num_pages = max(1, kv_bytes // (layout.bytes_per_token * tokens_per_page))
        cache = KVCache(layout, num_pages, dev, shared=shared_kv)
    identity = manifest.weights_digest if manifest is not None else _fingerprint(ckpt.weight_files())
    engine = Engine(lm, tokenizer, cache, tokens_per_page, identity=f"{identity}|quant={weight_quant}",
                    prefix_cache=prefix_cache)
    if graphs and ckpt.config.rope_scaling.type != "dynamic":
        engine.use_decode_graphs(graph_sizes)
    elif graphs and cuda_graphs is True:
        raise ModelLoadError("this model uses dynamic RoPE scaling, which CUDA graphs cannot replay; "
                             "load it with cuda_graphs=False")
    return engine


def _resolve_dtype(dtype: str, dev: torch.device) -> str:
    if dtype == "auto":
        return "bfloat16" if dev.type == "cuda" else "float32"
    return dtype


def _want_graphs(cuda_graphs: bool | str, dev: torch.device, kv_bytes: int | None) -> bool:
    """Whether to capture decode graphs; refuses a request that cannot be honoured."""
    if cuda_graphs not in (True, False, "auto"):
        raise ModelLoadError(f"cuda_graphs must be True, False or 'auto', got {cuda_graphs!r}")
    if cuda_graphs is True and (dev.type != "cuda" or kv_bytes is None):
        raise ModelLoadError("cuda_graphs=True needs a CUDA device and a KV pool (decode steps are what "
                             "the graphs replay); use cuda_graphs='auto' or False")
    return cuda_graphs is True or (cuda_graphs == "auto" and dev.type == "cuda" and kv_bytes is not None)


def _fingerprint(weight_files: list[str]) -> str:
    """A cheap identity of weights without a manifest: each file's name, size and modification time
    (hashing gigabytes on every load would be slow; a rewritten file changes its size or mtime)."""
    parts = []
    for path in weight_files:
        st = os.stat(path)
        parts.append(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}")
    return "files:" + ",".join(parts)
