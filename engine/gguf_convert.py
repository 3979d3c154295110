"""Convert a Llama-architecture GGUF file (e.g. the default SmolLM2 Q4_1) into a Hugging Face folder.

The folder (config.json, model.safetensors in fp32, tokenizer.json, tokenizer_config.json) is what the
rest of Tandem loads, so a GGUF is dequantized once and then treated like any checkpoint. Two GGUF
conventions are undone here: tensor shapes are stored innermost-first, and llama.cpp interleaves the
rotary pairs of the Q and K projections, which we put back into Hugging Face's "rotate half" order.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

from engine.errors import ModelLoadError

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_SPECIAL_TOKEN_TYPES = (3, 4)  # control and user-defined tokens in GGUF's token_type list


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.<i>.<name>.<weight|bias>
    if parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} in GGUF file")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """w: [n_heads * hd, ...] with rotary pairs interleaved -> the same rows in rotate-half order."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported: 'llama'")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": int(_field(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(_field(reader, "llama.rope.scaling.factor", 1.0))}
    return cfg


def _tokenizer(reader) -> tuple[dict, dict]:
    """tokenizer.json and tokenizer_config.json contents for a GGUF byte-level BPE vocabulary."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level "
                             f"BPE). Use the model's Hugging Face folder instead.")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = _field(reader, "tokenizer.ggml.merges")
    bos_id, eos_id = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, (t, ty) in enumerate(zip(tokens, types))
             if ty in _SPECIAL_TOKEN_TYPES]
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    post = None
    if add_bos and bos_id is not None:
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": tokens[bos_id], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tokens[bos_id]: {"id": tokens[bos_id], "ids": [bos_id], "tokens": [tokens[bos_id]]}}}
    tok_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": [m.split(" ", 1) for m in merges]},
    }
    tok_cfg = {"chat_template": _field(reader, "tokenizer.chat_template"),
               "bos_token": tokens[bos_id] if bos_id is not None else None,
               "eos_token": tokens[eos_id] if eos_id is not None else None,
               "add_bos_token": add_bos}
    return tok_json, tok_cfg


def convert_gguf(path: str, out_dir: str) -> None:
    """Write a Hugging Face folder for the GGUF at `path` into `out_dir` (which must exist and be empty)."""
    import gguf  # deferred: only needed when converting
    from tqdm import tqdm

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
    cfg = _config(reader)
    tok_json, tok_cfg = _tokenizer(reader)
    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=None, leave=False):
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF stores innermost dimension first
        arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = torch.from_numpy(arr.copy())
        if ".attn_q." in t.name:
            w = _unpermute_rotary(w, cfg["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = _unpermute_rotary(w, cfg["num_key_value_heads"])
        tensors[_hf_name(t.name)] = w
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for name, content in (("config.json", cfg), ("tokenizer.json", tok_json), ("tokenizer_config.json", tok_cfg)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(content, f, ensure_ascii=False)

