"""LoRA adapters in PEFT's saved format on the Llama-family model: low-rank updates to its linear layers,
applied to the rows of the requests that name the adapter, so requests of several adapters and of none
share a pass.

An adapter is a folder: adapter_config.json (`peft_type` LORA, `r`, `lora_alpha`, `use_rslora`) and
adapter_model.safetensors with `...layers.{i}.{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj.lora_{A,B}.weight`
(A: [r, in], B: [out, r]). A targeted projection's output gains scale * (x @ A.T) @ B.T, scale =
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), as PEFT computes it. What this engine would
otherwise ignore is refused at load, naming it: DoRA, LoRA biases, modules_to_save, per-module ranks or
alphas, layers_to_transform, fan_in_fan_out, and adapters of the embedding or the head.

The model's fused layers (engine/model.py: qkv, gate_up) take one update each: the parts' A stacked
[n*r, in] and their B block-diagonal [out, n*r] (zero where the adapter leaves a part alone), the scale
folded into B, so an update is two matmuls whichever parts are targeted.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from tandem.json_object import read_json_object

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj"
                  r"\.lora_([AB])(?:\.default)?\.weight")
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}  # model layer -> parts
_REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks",
            "alpha_pattern": "per-module alphas", "layers_to_transform": "layers_to_transform",
            "fan_in_fan_out": "fan_in_fan_out (transposed weights)"}


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # an adapter's name: what a request's `model` says


def modules_text(modules: dict[str, str]) -> str:
    """Adapters by name (their folders) as one config parameter: `name=folder;name=folder` ("" for none)."""
    return ";".join(f"{name}={folder}" for name, folder in modules.items())


def parse_modules(text: str) -> dict[str, str]:
    """modules_text's inverse."""
    return dict(item.split("=", 1) for item in text.split(";") if item)


def check_modules(modules: dict[str, str]) -> dict[str, str]:
    """`modules` (folder by name), each checked by check_module."""
    for name, folder in modules.items():
        check_module(name, folder)
    return modules


def check_module(name: str, folder: str) -> None:
    """ValueError naming what is wrong with adapter `name` in `folder`, before any weight is read: its
    name, the folder's name (it travels in modules_text), or its adapter_config.json."""
    if not NAME.fullmatch(name):
        raise ValueError(f"LoRA adapter name {name!r:.60} must be 1-128 letters, digits, '.', '_' or '-' "
                         f"(starting with a letter or digit)")
    if ";" in folder:
        raise ValueError(f"LoRA adapter {name!r}: its folder's path may not contain ';' ({folder!r:.200})")
    try:
        read_config(folder)
    except ModelLoadError as e:
        raise ValueError(f"LoRA adapter {name!r}: {e}") from None
    if not os.path.isfile(os.path.join(folder, WEIGHTS)):
        raise ValueError(f"LoRA adapter {name!r}: {folder} has no {WEIGHTS}")


@dataclass(frozen=True)
class Update:
    a: torch.Tensor  # [n*r, in]: the parts' A stacked
    b: torch.Tensor  # [out, n*r]: the parts' B block-diagonal, times the scale


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    layers: tuple[dict[str, Update], ...]  # per model layer: fused layer name (FUSED) -> its update


def load_adapter(name: str, folder: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> LoraAdapter:
    """The adapter in `folder` for a model of `cfg`; ModelLoadError naming what does not fit."""
    try:
        conf = read_config(folder)
    except ModelLoadError as e:
        raise ModelLoadError(f"LoRA adapter {name!r}: {e}") from None
    r, alpha = conf["r"], conf.get("lora_alpha", conf["r"])
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    from safetensors.torch import load_file

    path = os.path.join(folder, WEIGHTS)
    if not os.path.isfile(path):
        raise ModelLoadError(f"LoRA adapter {name!r}: {folder} has no {WEIGHTS}")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in load_file(path).items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise ModelLoadError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA update of a layer's "
                                 f"q/k/v/o/gate/up/down projection")
        parts.setdefault((int(m[1]), m[2]), {})[m[3]] = t
    if not parts:
        raise ModelLoadError(f"LoRA adapter {name!r}: {path} holds no LoRA update")
    dims = _dims(cfg)
    layers: list[dict[str, Update]] = [{} for _ in range(cfg.num_layers)]
    for (i, part), ab in sorted(parts.items()):
        d_in, d_out = dims[part]
        if i >= cfg.num_layers or set(ab) != {"A", "B"} or tuple(ab["A"].shape) != (r, d_in) \
                or tuple(ab["B"].shape) != (d_out, r):
            raise ModelLoadError(f"LoRA adapter {name!r}: layer {i} {part}_proj needs lora_A [{r}, {d_in}] and "
                                 f"lora_B [{d_out}, {r}] of a {cfg.num_layers}-layer model; got "
                                 f"{ {k: list(v.shape) for k, v in ab.items()} }")
    for i, layer in enumerate(layers):
        for fused, names in FUSED.items():
            got = [parts.get((i, p)) for p in names]
            if any(got):
                layer[fused] = _fused(got, [dims[p][1] for p in names], r, scale, device, dtype)
    return LoraAdapter(name, r, tuple(layers))


def read_config(folder: str) -> dict:
    """adapter_config.json, checked: a LoRA of a rank >= 1 and nothing this engine would ignore."""
    path = os.path.join(folder, CONFIG)
    try:
        conf = read_json_object(path)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    if conf.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"{path}: peft_type must be LORA, got {conf.get('peft_type')!r}")
    if not isinstance(conf.get("r"), int) or conf["r"] < 1:
        raise ModelLoadError(f"{path}: r (the rank) must be an integer >= 1, got {conf.get('r')!r}")
    alpha = conf.get("lora_alpha", conf["r"])
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ModelLoadError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    refused = [what for key, what in _REFUSED.items() if conf.get(key)]
    if conf.get("bias", "none") != "none":
        refused.append(f"bias {conf['bias']!r}")
    if refused:
        raise ModelLoadError(f"{path}: {', '.join(refused)} not supported (plain LoRA of the linear layers is)")
    return conf


def _dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features."""
    D, I, qd, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, \
        cfg.num_kv_heads * cfg.head_dim
    return {"q": (D, qd), "k": (D, kvd), "v": (D, kvd), "o": (qd, D), "gate": (D, I), "up": (D, I), "down": (I, D)}


def _fused(got: list[dict | None], outs: list[int], r: int, scale: float, device, dtype) -> Update:
    """One update of a fused layer from its parts' (A, B) (None: a part the adapter leaves alone)."""
    d_in = next(ab["A"].shape[1] for ab in got if ab)
    a = torch.zeros(len(got) * r, d_in)
    b = torch.zeros(sum(outs), len(got) * r)
    row = 0
    for j, (ab, out) in enumerate(zip(got, outs)):
        if ab:
            a[j * r:(j + 1) * r] = ab["A"].float()
            b[row:row + out, j * r:(j + 1) * r] = ab["B"].float() * scale
        row += out
    return Update(a.to(device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).contiguous())


@dataclass(frozen=True)
class LoraRows:
    """Which rows of a pass take which adapter's updates: (adapter, its rows [n], or None for all)."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor | None], ...]

    def add(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the fused layer's output for x [T, in]) plus each group's update at its rows, in place."""
        for adapter, rows in self.groups:
            u = adapter.layers[layer].get(fused)
            if u is None:
                continue
            if rows is None:
                y += (x @ u.a.T) @ u.b.T  # [T, n*r] -> [T, out]
            else:
                y.index_add_(0, rows, (x[rows] @ u.a.T) @ u.b.T)  # [n, out] into rows
        return y


def rows_of(adapters: dict[str, LoraAdapter], names: list[str], counts: list[int],
            device: torch.device) -> LoraRows | None:
    """The LoraRows of a pass whose sequence i (adapter `names[i]`, "" for none) has `counts[i]` rows in
    order; None when no sequence names an adapter."""
    if not any(names):
        return None
    if len(set(names)) == 1:
        return LoraRows(((adapters[names[0]], None),))
    groups: dict[str, list[int]] = {}
    offset = 0
    for name, n in zip(names, counts):
        if name:
            groups.setdefault(name, []).extend(range(offset, offset + n))
        offset += n
    return LoraRows(tuple((adapters[k], torch.tensor(v, device=device)) for k, v in groups.items()))
