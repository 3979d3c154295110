"""A pass of rows through every decoder layer in one call (decode_layers.cpp).

Each row attends as if it were its own sequence: a decode row over its context, a prompt row over the
keys up to its own position (the kernel writes every row's K/V before any row attends, so a prompt's
rows see each other causally). For decode rows these are the kernels engine/model.py's layer loop
runs, in its order, so up to the loop's own few-row limits the result is bit for bit the loop's; prompt
rows differ from the loop's PyTorch attention only by rounding. What the call saves is the ~10
interpreted calls per layer between the kernels (about a millisecond per decode step, ~20 ms of a
16-token fp32 prompt pass) and, for prompt rows, PyTorch's per-layer attention setup. It applies when
every product of every layer can use the few-row kernel (plain fp32/bf16 weights, no biases), the pass
has at most `max_rows` rows and its attention reads the pool in place (engine/attention.py:
Attention.in_place_rows); rows with LoRA adapters take their updates inside the call.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.cpu_kernels.build import load
from engine.cpu_kernels.gemv import onednn_takes
from engine.lora import LoraRows


def layer_weights(layers: list) -> list[torch.Tensor] | None:
    """The flat weight list `run_pass` takes (six per layer: attn_norm, qkv, o, mlp_norm, gate_up, down),
    or None when some product cannot go to the few-row kernel (engine/linear.py: Dense.packed)."""
    flat = []
    for L in layers:
        products = [getattr(d, "packed", None) for d in (L.qkv, L.o, L.gate_up, L.down)]
        if any(w is None for w in products) or load() is None:
            return None
        qkv, o, gate_up, down = products
        flat += [L.attn_norm, qkv, o, L.mlp_norm, gate_up, down]
    return flat


# The most rows a pass runs in one call. bf16: as many as its products take from the few-row kernel (past
# 16 oneDNN's AMX products in the layer loop win: 32 rows 127 ms in one call, 61 in the loop). fp32:
# measured, a prompt pass in one call against the layer loop in one process (python
# scripts/bench_one_call.py --prompt-lens 512,1024 --one-call-rows 4096; longer prompts alternated the same
# way in one engine), medians: 474/535 ms at 512 rows, 1041/1167 at 1024, 2831/2654 at 2048, 8474/6962 at
# 4096. Prompt rows attend in tiles of 4 that read each key once (decode_attention.cpp), where PyTorch's
# causal attention reads a key once per block of rows; past ~1500 rows the loop won. (Before the tiles,
# with a row's keys read once per row, the loop won past ~512. Since tiles of up to 16 rows past 1024
# keys, one call of 2048 rows is no faster than two rounds of 1024: 1979 against 1954 ms, two runs.)
# Where oneDNN has no bf16 (an AVX2 CPU) bf16 passes take fp32's limit: every product is the kernel's anyway.
_LIBRARY_BF16 = onednn_takes(torch.bfloat16)
ONE_CALL_ROWS = {torch.float32: 1024, torch.bfloat16: 16 if _LIBRARY_BF16 else 1024}


# Dtypes whose longer passes run as rounds of one call each (engine/passes.py), so that every row's bits
# are those of one arithmetic. fp32, one prompt of 1536 / 2048 / 4096 rows, medians in one process: against
# its pages (engine.extend, the prefill worker's pooled path and chunks) 1358 / 1993 / 5661 ms in rounds,
# 1762 / 2654 / 8093 in the loop (PyTorch's attention over gathered pages); a fresh prompt of 2048 / 4096
# rows (python scripts/bench_one_call.py --prompt-lens 2048,4096 --passes 3) 2001 / 5662 in rounds, 2085 /
# 5740 in the loop (its causal attention). Not bf16: past 16 rows the loop's oneDNN products are twice as
# fast as the one call's (where oneDNN has no bf16 there is no such product: bf16 runs in rounds as fp32 does).
IN_ROUNDS = {torch.float32} if _LIBRARY_BF16 else {torch.float32, torch.bfloat16}


def max_rows(dtype: torch.dtype) -> int:
    """The most rows a pass of this dtype may have to go through `run_pass` (0: none)."""
    return ONE_CALL_ROWS.get(dtype, 0)


def in_rounds(dtype: torch.dtype) -> bool:
    """Whether a pass of this dtype longer than `max_rows` runs in rounds of `run_pass` (else the layer loop)."""
    return dtype in IN_ROUNDS and max_rows(dtype) > 0


def run_pass(x: torch.Tensor, weights: list[torch.Tensor], in_place: tuple, cos: torch.Tensor, sin: torch.Tensor,
             heads: int, eps: float, after_layer: Callable[[int], None] | None = None,
             lora: LoraRows | None = None) -> torch.Tensor:
    """x: [B, D] (the pass's rows, embedded; updated in place) -> [B, D] after every layer and the last
    residual add. `weights` from `layer_weights`; `in_place`: (pool [layers, 2, pages, tpp, Hkv, hd],
    slots [B], tables [B, P], ctx_lens [B]: each row's own) from the pass's attention; cos, sin: [B, hd].
    `after_layer(i)` runs once layer i's K/V are in the pool; what it raises ends the pass and propagates.
    `lora`: the rows that take LoRA adapters' updates (engine/lora.py), as the layer loop gives them."""
    pool, slots, tables, lens = in_place
    groups = lora.flat() if lora is not None else []
    return load().decode_layers(x, weights, pool, cos, sin, slots, tables, lens, heads, eps, groups, after_layer)


def describe() -> str:
    limits = " / ".join(f"{n} {str(dt).removeprefix('torch.')}" for dt, n in ONE_CALL_ROWS.items())
    return f"passes of up to {limits} rows in one call" if load() else "one-call passes: not in use"
