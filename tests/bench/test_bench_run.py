"""A small end-to-end `tandem bench` run against the running server (seconds, not minutes)."""

from __future__ import annotations

import json
import subprocess
import sys


def bench(*args):
    return subprocess.run([sys.executable, "-m", "cli.main", "bench", *args], capture_output=True, text=True,
                          timeout=300)


def test_grpc_bench_writes_a_report_and_plots(served, tmp_path):
    out = tmp_path / "report"
    proc = bench("--url", served.grpc, "--requests", "5", "--concurrency", "2", "--prompt-len", "32",
                 "--output-len", "8", "--warmup", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TTFT p50 ms" in proc.stdout
    doc = json.loads((out / "report.json").read_text())
    s = doc["summary"]
    assert s["requests"] == 4 and s["failed"] == 0
    assert 0 < s["ttft_s"]["p50"] <= s["e2e_s"]["p50"] and s["output_tokens_per_s"] > 0
    assert all(r["output_tokens"] == 8 and len(r["response_times"]) >= 2 for r in doc["records"])
    for png in ("ttft-cdf.png", "itl-cdf.png", "timeline.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_openai_bench_with_poisson_arrivals(served):
    proc = bench("--url", served.http, "--protocol", "openai", "--requests", "4", "--rate", "4", "--prompt-len", "16",
                 "--output-len", "6", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| custom |" in proc.stdout and "| 0 |" in proc.stdout
