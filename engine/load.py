"""Build an Engine from whatever the user named: a model name, a GGUF, an HF folder or a role engine."""

from __future__ import annotations

import torch

from engine.checkpoint import resolve
from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.kv_pool import TORCH_DTYPES, KVCache
from engine.model import LlamaModel
from engine.tokenizer import Tokenizer
from tandem.kv_layout import KVLayout

DEFAULT_KV_BYTES = 1 << 30  # 1 GiB of KV pages unless told otherwise
DEFAULT_TOKENS_PER_PAGE = 16


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not supported; allowed: {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def load_engine(model: str, *, dtype: str = "float32", device: str = "cpu",
                tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE, kv_bytes: int | None = DEFAULT_KV_BYTES,
                shared_kv: bool = False, progress=None) -> Engine:
    """Load weights and tokenizer, and allocate a KV pool of `kv_bytes` (None: no pool, prefill-only)."""
    ckpt = resolve(model, progress)
    tdt = torch_dtype(dtype)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' asked for but no CUDA device is visible; use --device cpu")
    lm = LlamaModel(ckpt.config, ckpt.load_weights(), dev, tdt)
    tokenizer = Tokenizer(ckpt.folder)
    cache = None
    if kv_bytes is not None:
        c = ckpt.config
        layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, dtype, tokens_per_page)
        num_pages = max(1, kv_bytes // (layout.bytes_per_token * tokens_per_page))
        cache = KVCache(layout, num_pages, dev, shared=shared_kv)
    return Engine(lm, tokenizer, cache)
