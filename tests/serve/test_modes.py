"""Greedy outputs are identical in the three serving modes for the same prompts (through the front door)."""

from __future__ import annotations

from tests.serve.clients import grpc_infer
from tests.conftest import start_serve, stop_serve

PROMPTS = ["The capital of France is", "Here is a recipe for bread:",
           "Summarize: " + "the committee met on tuesday and approved the budget for the new library. " * 25]


def test_colocated_and_chunked_equal_disaggregated(served, built_engines, tmp_path):
    want = [grpc_infer(served.grpc, p, 16) for p in PROMPTS]
    for mode, extra in (("colocated", ()), ("chunked", ("--chunk-tokens", "32"))):
        s = start_serve(built_engines, tmp_path / mode, "--mode", mode, *extra)
        try:
            got = [grpc_infer(s.grpc, p, 16) for p in PROMPTS]
        finally:
            stop_serve(s)
        assert got == want, mode
