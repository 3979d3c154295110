"""LoRA adapters on the device: a random adapter's greedy tokens there (fp32) equal the CPU engine's
(fp32: the reference tests/engine/test_lora.py holds to PEFT's own), a batch mixing adapter and base rows
gives each row its own model's tokens (the base rows still on CUDA graphs where the engine has them), and
what an adapter costs a bf16 decode step there.

The adapter is written in PEFT's format (rank 16 on every q/k/v/o/gate/up/down projection) for whatever
model the check runs, and loaded as `tandem serve --lora-modules` loads it (engine/lora.py).
"""

from __future__ import annotations

import json
import os
import time

import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.lora_files import dims
from scripts.gpu_check.device_rates import sync
from scripts.gpu_check.exactness_check import compare, run_batch
from tandem.sampling_params import SamplingParams

RANK = 16
_MODULE = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn", "gate": "mlp", "up": "mlp",
           "down": "mlp"}


def write_adapter(folder: str, cfg: ModelConfig, seed: int = 0, rank: int = RANK) -> str:
    """A random rank-`rank` LoRA of a model of `cfg` on every projection, in PEFT's saved format in
    `folder` (B small, so answers change but stay text); scripts/bench_lora.py writes its adapters so too."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for part, (d_in, d_out) in dims(cfg).items():
            key = f"base_model.model.model.layers.{i}.{_MODULE[part]}.{part}_proj"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.02
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}, f)
    return folder


def exactness(load, folder: str, device: torch.device, prompts: list[list[int]], max_tokens: int) -> dict:
    """`load(dtype, device, lora_modules)` makes an engine. fp32 adapter tokens on `device` vs the CPU's;
    a batch alternating adapter and base rows vs each alone; and whether the adapter changes answers."""
    modules = {"tuned": folder}
    ours = load("float32", str(device), modules)
    tuned = run_batch(ours, prompts, max_tokens, ["tuned"] * len(prompts))
    base = run_batch(ours, prompts, max_tokens)
    mixed = run_batch(ours, prompts, max_tokens, ["tuned" if i % 2 else "" for i in range(len(prompts))])
    want_mixed = [(tuned if i % 2 else base)[i] for i in range(len(prompts))]
    del ours
    reference = run_batch(load("float32", "cpu", modules), prompts, max_tokens, ["tuned"] * len(prompts))
    return {"vs_cpu": compare(tuned, reference), "mixed_batch": compare(mixed, want_mixed),
            "adapter_changes_answers": sum(t != b for t, b in zip(tuned, base))}


def decode_cost(engine, batch: int, steps: int, prompt_len: int = 64) -> dict:
    """bf16 decode tokens/s of `batch` sequences: base rows, adapter rows, half and half (every case run
    twice, in turn, the second run counted: the first warms what each path allocates)."""
    cases = {"base": [""] * batch, "adapter": ["tuned"] * batch,
             "half": ["tuned", ""] * (batch // 2) + [""] * (batch % 2)}
    out = {}
    for _ in range(2):
        out = {case: {"tokens_per_s": decode_rate(engine, loras, steps, prompt_len)} for case, loras in cases.items()}
    for case in ("adapter", "half"):
        out[case]["vs_base"] = round(out[case]["tokens_per_s"] / out["base"]["tokens_per_s"], 3)
    return out


def decode_rate(engine, loras: list[str], steps: int, prompt_len: int = 64) -> float:
    """Output tokens/s of `steps` decode steps of one sequence per entry of `loras` (its adapter)."""
    seqs = [engine.new_sequence(f"c{i}", [3 + (i * 7 + j) % 1000 for j in range(prompt_len)],
                                SamplingParams(max_tokens=steps + 1, ignore_eos=True, lora=a))
            for i, a in enumerate(loras)]
    for s in seqs:
        engine.admit(s)
    try:
        engine.prefill(seqs)
        sync(engine.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.decode_step(seqs)
        sync(engine.device)
        return round(steps * len(seqs) / (time.perf_counter() - t0), 1)
    finally:
        for s in seqs:
            engine.release(s)
