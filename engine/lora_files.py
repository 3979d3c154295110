"""LoRA adapter files (PEFT's saved format), read and checked without torch: the names and folders a
deployment gives, adapter_config.json, and the tensors' names and shapes from the safetensors header
alone. engine/lora.py loads the weights; the front door checks an adapter here before any worker starts,
in a process that never imports torch.

An adapter is a folder: adapter_config.json (`peft_type` LORA, `r`, `lora_alpha`, `use_rslora`) and
adapter_model.safetensors with `...layers.{i}.{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj.lora_{A,B}.weight`
(A: [r, in], B: [out, r]). What the engine would otherwise ignore is refused, naming it: DoRA, LoRA
biases, modules_to_save, per-module ranks or alphas, layers_to_transform, fan_in_fan_out, and adapters of
the embedding or the head.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from tandem.json_object import read_json_object

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj"
                  r"\.lora_([AB])(?:\.default)?\.weight")
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


def dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features."""
    D, I, qd, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, \
        cfg.num_kv_heads * cfg.head_dim
    return {"q": (D, qd), "k": (D, kvd), "v": (D, kvd), "o": (qd, D), "gate": (D, I), "up": (D, I), "down": (I, D)}


def parts_of(name: str, shapes: dict[str, tuple[int, ...]], r: int,
             cfg: ModelConfig) -> dict[tuple[int, str], dict[str, str]]:
    """The adapter's tensors (name -> shape) by (layer, projection) -> {"A": name, "B": name}, each pair
    checked against a model of `cfg` at rank `r`; ModelLoadError naming the first that does not fit."""
    parts: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        m = _KEY.fullmatch(key)
        if m is None:
            raise ModelLoadError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA update of a layer's "
                                 f"q/k/v/o/gate/up/down projection")
        parts.setdefault((int(m[1]), m[2]), {})[m[3]] = key
    if not parts:
        raise ModelLoadError(f"LoRA adapter {name!r}: its {WEIGHTS} holds no LoRA update")
    projections = dims(cfg)
    for (i, part), ab in sorted(parts.items()):
        d_in, d_out = projections[part]
        got = {k: list(shapes[v]) for k, v in ab.items()}
        if i >= cfg.num_layers or got != {"A": [r, d_in], "B": [d_out, r]}:
            raise ModelLoadError(f"LoRA adapter {name!r}: layer {i} {part}_proj needs lora_A [{r}, {d_in}] and "
                                 f"lora_B [{d_out}, {r}] of a {cfg.num_layers}-layer model; got {got}")
    return parts


def check_against(name: str, folder: str, cfg: ModelConfig) -> None:
    """ModelLoadError naming what of adapter `name` in `folder` a model of `cfg` cannot take, read from
    its config and its safetensors header (no weight is read)."""
    try:
        r, shapes = read_config(folder)["r"], header_shapes(os.path.join(folder, WEIGHTS))
    except ModelLoadError as e:
        raise ModelLoadError(f"LoRA adapter {name!r}: {e}") from None
    parts_of(name, shapes, r, cfg)


def header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a safetensors file, from its header (8 bytes of length, then JSON)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"a header of {size} bytes")
            head = json.loads(f.read(size))
        return {k: tuple(v["shape"]) for k, v in head.items() if k != "__metadata__"}
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"cannot read the safetensors header of {path}: {e}") from None
