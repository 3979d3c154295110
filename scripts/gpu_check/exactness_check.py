"""Correctness on the device: fp32 greedy tokens equal transformers', CUDA graphs equal eager, bf16
agrees with fp32 (a sanity bound, not exactness: bf16 rounds differently from the first layer on)."""

from __future__ import annotations

import torch

from engine.engine import Engine
from engine.tokenizer import ChatMessage
from tandem.sampling_params import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Count from one to five.",
           "Name a color.", "Explain what a GPU is in one sentence.", "List three fruits.",
           "What is two plus two?", "Translate 'good morning' into French."]


def prompt_ids(engine: Engine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    encode = (lambda p: tok.encode_chat([ChatMessage("user", p)])) if tok.chat_template else tok.encode
    return [encode(p) for p in PROMPTS[:n]]


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int,
              loras: list[str] | None = None) -> list[list[int]]:
    """Greedy answers of all prompts decoded together (one batch that shrinks as rows finish); prompt i
    with LoRA adapter loras[i] ("" or no list: the base model)."""
    seqs = [engine.new_sequence(f"x{i}", p, SamplingParams(max_tokens=max_tokens, lora=loras[i] if loras else ""))
            for i, p in enumerate(prompts)]
    for s in seqs:
        engine.admit(s)
    try:
        engine.prefill(seqs)
        while not all(s.finished for s in seqs):
            engine.decode_step([s for s in seqs if not s.finished])
    finally:
        for s in seqs:
            engine.release(s)
    return [s.output_ids for s in seqs]


def hf_greedy(folder: str, device: torch.device, prompts: list[list[int]], max_tokens: int,
              eos: set[int]) -> list[list[int]]:
    """transformers' own greedy answers (fp32), cut after the first EOS as the engine stops there."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=sorted(eos), pad_token_id=min(eos))[0, len(ids):].tolist()
            cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
            outs.append(out[:cut])
    del model
    return outs


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    """Exact matches, and how far each answer agrees with its reference before the first difference."""
    prefix = []
    for g, w in zip(got, want):
        n = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        prefix.append(n / max(1, max(len(g), len(w))))
    return {"exact": sum(g == w for g, w in zip(got, want)), "of": len(want),
            "first_token_agree": sum(bool(g) and bool(w) and g[0] == w[0] for g, w in zip(got, want)),
            "mean_agreeing_prefix": round(sum(prefix) / len(prefix), 3),
            "distinct_tokens": len({t for g in got for t in g})}


def fp32_checks(engine32: Engine, folder: str, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list]:
    """fp32 vs transformers (graphs on where the engine has them) and graphs vs eager."""
    ours = run_batch(engine32, prompts, max_tokens)
    res = {"vs_transformers": compare(ours, hf_greedy(folder, engine32.device, prompts, max_tokens,
                                                      set(engine32.eos_ids)))}
    if engine32.graphs is not None:
        graphs, engine32.graphs = engine32.graphs, None
        try:
            res["graphs_vs_eager"] = compare(ours, run_batch(engine32, prompts, max_tokens))
        finally:
            engine32.graphs = graphs
        res["graph_shapes"] = [list(s) for s in graphs.captured]
    return res, ours


def bf16_sanity(engine16: Engine, prompts: list[list[int]], max_tokens: int, fp32_answers: list) -> dict:
    ours = run_batch(engine16, prompts, max_tokens)
    res = compare(ours, fp32_answers)
    res["sample_answer"] = engine16.tokenizer.decode(ours[0])[:80]
    return res

