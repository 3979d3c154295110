"""LoRA adapters on the Llama-family model: low-rank updates to its linear layers, applied to the rows of
the requests that name the adapter, so requests of several adapters and of none share a pass.

An adapter (PEFT's saved format, read and checked by engine/lora_files.py) adds to a targeted
projection's output scale * (x @ A.T) @ B.T, scale = lora_alpha / r (lora_alpha / sqrt(r) with
use_rslora), as PEFT computes it. The model's fused layers (engine/model.py: qkv, gate_up) take one
update each: the parts' A stacked [n*r, in] and their B block-diagonal [out, n*r] (zero where the adapter
leaves a part alone), the scale folded into B, so an update is two matmuls whichever parts are targeted.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.lora_files import WEIGHTS, dims, parts_of, read_config

FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}  # model layer -> parts


@dataclass(frozen=True)
class Update:
    a_t: torch.Tensor  # [in, n*r]: the parts' A stacked, transposed
    b_t: torch.Tensor  # [n*r, out]: the parts' B block-diagonal, times the scale, transposed


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    layers: tuple[dict[str, Update], ...]  # per model layer: fused layer name (FUSED) -> its update

    @functools.cached_property
    def flat(self) -> list[torch.Tensor | None]:
        """The updates as the one-call pass takes them (engine/cpu_kernels/layers.py): a_t, b_t of each
        layer's qkv, o, gate_up and down in turn, None for both where the adapter leaves one alone."""
        return [t for layer in self.layers for fused in FUSED
                for t in ((layer[fused].a_t, layer[fused].b_t) if fused in layer else (None, None))]


def load_adapter(name: str, folder: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> LoraAdapter:
    """The adapter in `folder` for a model of `cfg`; ModelLoadError naming what does not fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.path.join(folder, WEIGHTS)
    try:
        conf = read_config(folder)
        tensors = load_file(path)
    except (ModelLoadError, OSError, SafetensorError) as e:  # a damaged file included
        raise ModelLoadError(f"LoRA adapter {name!r}: {e}") from None
    r, alpha = conf["r"], conf.get("lora_alpha", conf["r"])
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    parts = parts_of(name, {k: tuple(t.shape) for k, t in tensors.items()}, r, cfg)
    outs = {p: d_out for p, (_, d_out) in dims(cfg).items()}
    layers: list[dict[str, Update]] = [{} for _ in range(cfg.num_layers)]
    for i, layer in enumerate(layers):
        for fused, names in FUSED.items():
            got = [parts.get((i, p)) for p in names]
            if any(got):
                pairs = [(tensors[ab["A"]], tensors[ab["B"]]) if ab else None for ab in got]
                layer[fused] = _fused(pairs, [outs[p] for p in names], r, scale, device, dtype)
    return LoraAdapter(name, r, tuple(layers))


def adapters_for(held: dict[str, LoraAdapter], modules: dict[str, str], cfg: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> dict[str, LoraAdapter]:
    """The adapters of `modules` (folder by name): those in `held` as they are, the others loaded from their
    folders; an adapter of `held` that `modules` leaves out is not in it. ModelLoadError (nothing changed)
    naming the first that cannot be loaded."""
    return {name: held[name] if name in held else load_adapter(name, folder, cfg, device, dtype)
            for name, folder in modules.items()}


def _fused(pairs: list[tuple[torch.Tensor, torch.Tensor] | None], outs: list[int], r: int, scale: float, device,
           dtype) -> Update:
    """One update of a fused layer from its parts' (A [r, in], B [out, r]) (None: a part left alone)."""
    d_in = next(a.shape[1] for a, _ in filter(None, pairs))
    a = torch.zeros(len(pairs) * r, d_in)
    b = torch.zeros(sum(outs), len(pairs) * r)
    row = 0
    for j, (pair, out) in enumerate(zip(pairs, outs)):
        if pair is not None:
            a[j * r:(j + 1) * r] = pair[0].float()
            b[row:row + out, j * r:(j + 1) * r] = pair[1].float() * scale
        row += out
    return Update(a.T.to(device=device, dtype=dtype).contiguous(), b.T.to(device=device, dtype=dtype).contiguous())


MASK_ROWS = 64  # a pass of at most this many rows selects a group's rows by a mask (fewer ops), else by index


@dataclass(frozen=True)
class LoraRows:
    """Which rows of a pass take which adapter's updates: (adapter, its rows), the rows None (all of them),
    a 0/1 mask [T, 1] in the model's dtype (a pass of few rows: every row computed, the others' zeroed),
    or their indices [n] (a long pass: only its rows computed)."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor | None], ...]

    def flat(self) -> list[list[torch.Tensor | None]]:
        """The groups as the one-call pass takes them: each its rows (None: all), then its adapter's `flat`."""
        return [[rows, *adapter.flat] for adapter, rows in self.groups]

    def add(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the fused layer's output for x [T, in]) plus each group's update at its rows, in place."""
        for adapter, rows in self.groups:
            u = adapter.layers[layer].get(fused)
            if u is None:
                continue
            if rows is None:
                y.addmm_(x.mm(u.a_t), u.b_t)  # [T, n*r] -> [T, out]
            elif rows.dtype == torch.long:
                y.index_add_(0, rows, x[rows].mm(u.a_t).mm(u.b_t))  # [n, out] into rows
            else:
                y.addmm_(x.mm(u.a_t).mul_(rows), u.b_t)  # other rows' [n*r] zeroed: they add exactly 0
        return y


def rows_of(adapters: dict[str, LoraAdapter], names: list[str], counts: list[int], device: torch.device,
            dtype: torch.dtype) -> LoraRows | None:
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
    total = sum(counts)
    if total > MASK_ROWS:
        return LoraRows(tuple((adapters[k], torch.tensor(v, device=device)) for k, v in groups.items()))
    masks = torch.zeros(len(groups), total, 1, dtype=dtype)  # [G, T, 1]
    for g, rows in enumerate(groups.values()):
        masks[g, rows] = 1
    masks = masks.to(device)  # one upload
    return LoraRows(tuple((adapters[k], masks[g]) for g, k in enumerate(groups)))
