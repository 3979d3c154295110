#!/usr/bin/env python
"""What structured output costs the engine: decode steps of a batch whose rows all follow a JSON
schema against the same batch generating free text, side by side in one run (interleaved rounds, the
median of each), plus the time the batch's grammar masks take, per row.

    scripts/bench_guided.py [--batch 1 8 32] [--tokens 64] [--rounds 5] [--dtype float32]

Both sides decode exactly `--tokens` tokens per row: free rows ignore the end token, guided rows follow
a schema whose one string is longer than that, so neither finishes early.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.guided import masks  # noqa: E402
from engine.load import load_engine  # noqa: E402
from engine.tokenizer import ChatMessage  # noqa: E402
from tandem.guides import Guide, GuideKind  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000, "maxLength": 4000}},
          "required": ["story"]}


def steps_ms(engine, prompt: list[int], batch: int, tokens: int, guide: Guide | None) -> tuple[float, float]:
    """(median ms per decode step of `batch` rows, ms of the masks per row) for one round."""
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.8, seed=1, ignore_eos=True, guide=guide)
    seqs = [engine.new_sequence(f"r{i}", prompt, params) for i in range(batch)]
    for s in seqs:
        engine.admit(s)
    engine.prefill(seqs)
    times = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        engine.decode_step(seqs)
        times.append((time.perf_counter() - t0) * 1e3)
    grammar = 0.0
    if guide is not None:  # the masks' share, measured apart on the final states
        t0 = time.perf_counter()
        masks([s.guide for s in seqs], engine.cfg.vocab_size)
        grammar = (time.perf_counter() - t0) * 1e3 / batch
    for s in seqs:
        engine.release(s)
    return statistics.median(times), grammar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    engine = load_engine(args.model, kv_bytes=1 << 30, dtype=args.dtype)
    prompt = engine.tokenizer.encode_chat([ChatMessage("user", "Tell me a long story about a fox, as JSON.")])
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA))
    steps_ms(engine, prompt, 1, 4, guide)  # warm-up: builds the grammar tokenizer once
    print(f"{args.model} {args.dtype}, {args.tokens} tokens per row, median of {args.rounds} interleaved rounds")
    print("| batch | free text ms/step | JSON schema ms/step | ratio | grammar mask ms/row |")
    print("|---|---|---|---|---|")
    for batch in args.batch:
        free, guided, masks = [], [], []
        for _ in range(args.rounds):
            free.append(steps_ms(engine, prompt, batch, args.tokens, None)[0])
            step, mask = steps_ms(engine, prompt, batch, args.tokens, guide)
            guided.append(step)
            masks.append(mask)
        f, g = statistics.median(free), statistics.median(guided)
        print(f"| {batch} | {f:.2f} | {g:.2f} | {g / f:.2f} | {statistics.median(masks):.3f} |")


if __name__ == "__main__":
    main()
