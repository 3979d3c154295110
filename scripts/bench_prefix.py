#!/usr/bin/env python
"""The prefix-cache benchmark (docs/benchmarks/prefix-cache), two commands:

    scripts/bench_prefix.py sweep   the conditional-disaggregation threshold (sweep.md / sweep.json)
    scripts/bench_prefix.py run     the multi-turn workload on 1P1D, 2P2D and co-located replicas, cache off
                                    vs on vs on + KV-aware routing vs conditional disaggregation (report.md)

`--short` runs a small version of either (a smoke test of the harness, not numbers to publish).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cli.bench_cmd import _tokenizer  # noqa: E402
from clients.bench.multiturn import MultiTurn  # noqa: E402
from clients.bench.prefix_suite import run_prefix_suite, variants  # noqa: E402
from clients.bench.threshold_sweep import run_sweep  # noqa: E402
from ops.deployment import DEFAULT_LOCAL_PREFILL_TOKENS  # noqa: E402

OUT = os.path.join("docs", "benchmarks", "prefix-cache")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["sweep", "run"])
    ap.add_argument("--engines", default="smollm2-135m", help="Model or engines folder to serve.")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--short", action="store_true", help="A small version: checks the harness, in minutes.")
    ap.add_argument("--protocol", choices=["grpc", "openai"], default="openai")
    ap.add_argument("--kv-pool-bytes", type=int, default=1 << 30)
    ap.add_argument("--threshold", type=int, default=None,
                    help="run: conditional threshold (default: the sweep's, else the deployment default).")
    ap.add_argument("--only", default="", help=f"run: comma-separated variants of {list(variants(0))}")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tokenizer = _tokenizer(None)
    if args.command == "sweep":
        lengths = [32, 128, 384] if args.short else [16, 32, 64, 128, 256, 512]
        doc = run_sweep(args.engines, args.out, lengths, reps=2 if args.short else 5,
                        prefix_tokens=256 if args.short else 512, background=2, kv_pool_bytes=args.kv_pool_bytes,
                        tokenizer=tokenizer, log=lambda m: print(m, file=sys.stderr))
        print(f"threshold: {doc['threshold']} tokens; {os.path.join(args.out, 'sweep.md')}")
        return
    spec = MultiTurn(2, 3, 128, 32, 16) if args.short else MultiTurn(8, 6, 512, 64, 64)
    threshold = args.threshold if args.threshold is not None else _swept(args.out)
    only = [v.strip() for v in args.only.split(",") if v.strip()] or None
    doc = run_prefix_suite(args.engines, args.out, spec, args.protocol, threshold, args.kv_pool_bytes,
                           (1.5, 0.15), tokenizer, only, log=lambda m: print(m, file=sys.stderr))
    with open(os.path.join(args.out, "report.md")) as f:
        print(f.read())
    missed = [label for label, r in doc["versus_cache_off"].items() if not r["meets_targets"]]
    if missed:
        print(f"note: {', '.join(missed)} miss the targets (see the report)", file=sys.stderr)


def _swept(out: str) -> int:
    """The threshold the last sweep picked, else the deployment's default."""
    path = os.path.join(out, "sweep.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)["threshold"]
    return DEFAULT_LOCAL_PREFILL_TOKENS


if __name__ == "__main__":
    main()
