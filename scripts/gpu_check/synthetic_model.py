"""The model the device check runs: a checkpoint the user names, or a synthetic one made on the spot.

The default model's weights (a 94 MiB GGUF, 538 MB once dequantized) do not fit the 64 MiB that may be
carried to a device machine. So, unless --model names a checkpoint there, the check writes a model
with the real architecture (the kit's config.json) and seeded random weights: the same bytes per
step and the same kernels, so every rate measured is the real model's rate. Exactness against
transformers needs only that both load the same weights; sensible text needs real ones (--model).

The kit (`--prepare-kit DIR`, made where the default model is installed) is config.json,
tokenizer.json and tokenizer_config.json: about 2 MB.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

KIT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
# a dry run's model: the kit's tokenizer and vocabulary, two small layers
DRY_RUN_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
EMBED_STD = 0.1  # larger than the usual 0.02 so the head's logits are peaked: greedy near-ties are rare
MATRIX_STD = 0.04


def prepare_kit(out_dir: str, model: str = "smollm2-135m") -> str:
    """Copy the small files of `model`'s checkpoint folder (converting a GGUF here if needed) to out_dir."""
    from engine.checkpoint import resolve

    folder = resolve(model).folder
    os.makedirs(out_dir, exist_ok=True)
    for name in KIT_FILES:
        src = os.path.join(folder, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))
    return out_dir


def synthetic_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random fp32 weights named as a Hugging Face Llama checkpoint names them."""
    g = torch.Generator().manual_seed(seed)
    D, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape, std=MATRIX_STD):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rand(cfg["vocab_size"], D, std=EMBED_STD),
         "model.norm.weight": torch.ones(D)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(D), p + "post_attention_layernorm.weight": torch.ones(D),
              p + "self_attn.q_proj.weight": rand(H * hd, D), p + "self_attn.k_proj.weight": rand(Hkv * hd, D),
              p + "self_attn.v_proj.weight": rand(Hkv * hd, D), p + "self_attn.o_proj.weight": rand(D, H * hd),
              p + "mlp.gate_proj.weight": rand(I, D), p + "mlp.up_proj.weight": rand(I, D),
              p + "mlp.down_proj.weight": rand(D, I)}
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = rand(cfg["vocab_size"], D, std=EMBED_STD)
    return w


def make_synthetic(kit_dir: str, out_dir: str, dry_run: bool) -> str:
    """A Hugging Face style folder: the kit's tokenizer, its config (shrunk for a dry run), random weights."""
    from safetensors.torch import save_file

    missing = [n for n in KIT_FILES[:2] if not os.path.isfile(os.path.join(kit_dir, n))]
    if missing:
        raise SystemExit(f"gpu-check: kit {kit_dir} lacks {missing}; make it with "
                         f"'scripts/gpu-check --prepare-kit {kit_dir}' where the default model is installed")
    with open(os.path.join(kit_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if dry_run:
        cfg |= DRY_RUN_SIZES
    # a separate random output head: with a tied one, random weights answer one token over and over
    # (each embedding is nearest to itself). A step reads the same bytes either way.
    cfg["tie_word_embeddings"] = False
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    os.makedirs(out_dir, exist_ok=True)
    for name in KIT_FILES[1:]:
        if os.path.isfile(os.path.join(kit_dir, name)):
            shutil.copyfile(os.path.join(kit_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    weights = synthetic_weights(cfg)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    return out_dir


def model_folder(model: str | None, kit_dir: str, work_dir: str, dry_run: bool) -> tuple[str, str]:
    """(checkpoint the engine and transformers load, a one-line description of its weights)."""
    if model:
        from engine.checkpoint import resolve

        return resolve(model).folder, f"checkpoint {model}"
    folder = make_synthetic(kit_dir, os.path.join(work_dir, "synthetic"), dry_run)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    return folder, (f"synthetic: seeded random weights, {c['num_hidden_layers']} layers x hidden {c['hidden_size']} "
                    f"(architecture and tokenizer from {kit_dir})")
