"""Benchmark reports: one JSON document and a Markdown table per scenario."""

from __future__ import annotations

import json
import os

from clients.bench.stats import RequestRecord

COLUMNS = (("TTFT p50", "ttft_s", "p50", 1e3), ("TTFT p99", "ttft_s", "p99", 1e3), ("ITL p50", "itl_s", "p50", 1e3),
           ("ITL p99", "itl_s", "p99", 1e3), ("ITL max", "itl_s", "max", 1e3), ("E2E p50", "e2e_s", "p50", 1e3))


def row(label: str, s: dict) -> str:
    if "error" in s:
        return f"| {label} | " + " | ".join(["-"] * (len(COLUMNS) + 3)) + f" | {s['error']} |"
    cells = [f"{s[k][q] * scale:.0f}" for _, k, q, scale in COLUMNS]
    cells += [f"{s['throughput_rps']:.2f}", f"{s['output_tokens_per_s']:.1f}", f"{s['goodput_rps']:.2f}"]
    return f"| {label} | " + " | ".join(cells) + f" | {s['failed']} |"


def table(results: dict[str, dict]) -> str:
    """results: label -> summary dict. Latencies in ms."""
    head = "| | " + " | ".join(f"{c} ms" for c, *_ in COLUMNS) + " | req/s | out tok/s | goodput req/s | failed |"
    sep = "|---" * (len(COLUMNS) + 5) + "|"
    return "\n".join([head, sep] + [row(label, s) for label, s in results.items()])


def records_json(records: list[RequestRecord]) -> list[dict]:
    return [{"stream": r.stream, "start": r.start, "response_times": r.response_times, "output_tokens": r.output_tokens,
             "prompt_tokens": r.prompt_tokens, "error": r.error, "warmup": r.warmup} for r in records]


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
