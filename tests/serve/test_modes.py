"""Greedy outputs, and sampled structured outputs, are identical in the three serving modes for the same
prompts (through the front door)."""

from __future__ import annotations

from tests.serve.clients import grpc_infer, post
from tests.conftest import start_serve, stop_serve

PROMPTS = ["The capital of France is", "Here is a recipe for bread:",
           "Summarize: " + "the committee met on tuesday and approved the budget for the new library. " * 25]
GUIDED = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0.9, "seed": 4,
          "guided_json": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


def _guided(url: str) -> str:
    status, body = post(url, "/v1/completions", GUIDED)
    assert status == 200, body
    return body["choices"][0]["text"]


def test_colocated_and_chunked_equal_disaggregated(served, built_engines, tmp_path):
    want = [grpc_infer(served.grpc, p, 16) for p in PROMPTS] + [_guided(served.http)]
    assert want[-1].startswith('{"city": "')
    for mode, extra in (("colocated", ()), ("chunked", ("--chunk-tokens", "32"))):
        s = start_serve(built_engines, tmp_path / mode, "--mode", mode, *extra)
        try:
            got = [grpc_infer(s.grpc, p, 16) for p in PROMPTS] + [_guided(s.http)]
        finally:
            stop_serve(s)
        assert got == want, mode
