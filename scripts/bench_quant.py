#!/usr/bin/env python3
"""Weight-only int8 for the decode role vs fp32, measured side by side in one run.

Builds the default model's decode engine three ways (fp32, int8 weight-only, int8 with dynamic
activation quantization), then prints for each: weight bytes, decode tokens/s at batch 1 and 32,
perplexity on a fixed ~2k-token text (Python's own reference documentation, shipped with every
Python), and greedy agreement with fp32 on a set of chat prompts.

    python scripts/bench_quant.py [--threads 2] [--out /tmp/tandem-quant]
"""

from __future__ import annotations

import argparse
import os

import torch
from pydoc_data.topics import topics

from bench_engine import ours_decode, prompts  # scripts/ is on sys.path when this runs as a script
from builder.build import BuildRequest, build
from engine.evaluate import perplexity
from engine.generate import run_generation
from engine.load import load_engine
from tandem.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from tandem.roles import Role

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
           "List three uses of copper.", "What is 15 + 27?", "Describe a cat in one sentence.",
           "Give me a tip for learning to code.", "Why do leaves change color in autumn?"]
TEXT_TOPICS = ("execmodel", "exceptions", "import")


def eval_text(tokenizer, n_tokens: int = 2048) -> list[int]:
    text = "\n\n".join(topics[t] for t in TEXT_TOPICS)
    return tokenizer.encode(text)[:n_tokens]


def decode_tps(engine, batch: int, new_tokens: int = 24) -> float:
    return ours_decode(engine, prompts(engine.tokenizer, batch, 16), new_tokens)


def greedy(engine, max_tokens: int = 32) -> list[list[int]]:
    return [run_generation(engine, engine.tokenizer.encode_chat([ChatMessage("user", p)]),
                           SamplingParams(max_tokens=max_tokens)).token_ids for p in PROMPTS]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(prompts with identical output, mean fraction of leading tokens that agree)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(n / max(len(x), 1))
    return same, sum(prefix) / len(prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="/tmp/tandem-quant")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, ref_greedy, ref_ppl = [], None, None
    for quant in ("none", "int8", "int8-dynamic"):
        out = os.path.join(args.out, quant)
        build(BuildRequest(model="smollm2-135m", out=out, roles=(Role.DECODE,), weight_quant=quant),
              log=lambda *_: None)
        engine = load_engine(os.path.join(out, "decode"), kv_bytes=256 << 20)
        ids = eval_text(engine.tokenizer)
        ppl = perplexity(engine.model, ids)
        g = greedy(engine)
        b1 = max(decode_tps(engine, 1) for _ in range(2))
        b32 = max(decode_tps(engine, 32) for _ in range(2))
        if quant == "none":
            ref_greedy, ref_ppl = g, ppl
        same, prefix = agreement(ref_greedy, g)
        rows.append((quant, engine.model.weight_bytes / 1e6, b1, b32, ppl, ppl / ref_ppl, same, prefix))
        del engine
    print(f"threads={args.threads}  eval text: {len(ids)} tokens  greedy prompts: {len(PROMPTS)} x 32 tokens")
    print(f"{'weights':>13} {'MB read/step':>12} {'b1 tok/s':>9} {'b32 tok/s':>10} {'ppl':>8} {'ppl/fp32':>9} "
          f"{'same outputs':>13} {'agree prefix':>13}")
    for q, mb, b1, b32, ppl, rel, same, prefix in rows:
        print(f"{q:>13} {mb:>12.0f} {b1:>9.1f} {b32:>10.1f} {ppl:>8.3f} {rel:>9.4f} {same:>9}/{len(PROMPTS)} "
              f"{prefix:>12.0%}")


if __name__ == "__main__":
    main()
