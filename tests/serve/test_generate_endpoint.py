"""Triton's generate extension and model statistics on the HTTP door (the curl path of TensorRT-LLM's docs)."""

from __future__ import annotations

import json
import subprocess
import urllib.request

from engine.generate import run_generation
from tandem.sampling_params import SamplingParams
from tests.serve.clients import post

PROMPT = "The capital of France is"


def _stats(http: str) -> dict:
    with urllib.request.urlopen(http + "/v2/models/ensemble/stats", timeout=30) as r:
        return json.loads(r.read())["model_stats"][0]


def test_generate_and_generate_stream_by_curl(served, default_engine):
    want = run_generation(default_engine, default_engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=12)).text
    before = _stats(served.http)["inference_stats"]["success"]["count"]
    body = json.dumps({"text_input": PROMPT, "max_tokens": 12, "parameters": {"temperature": 0.0}})
    out = subprocess.run(["curl", "-sS", "-X", "POST", served.http + "/v2/models/ensemble/generate", "-d", body],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    reply = json.loads(out)
    assert reply["model_name"] == "ensemble" and reply["model_version"] == "1"
    assert reply["text_output"] == PROMPT + want  # the ensemble's default: the prompt, then the answer
    assert reply["num_output_tokens"] == 12
    body = json.dumps({"text_input": PROMPT, "parameters": {"max_tokens": 12, "return_log_probs": True}})
    out = subprocess.run(["curl", "-sS", "-N", "-X", "POST", served.http + "/v2/models/ensemble/generate_stream",
                          "-d", body], capture_output=True, text=True, timeout=120, check=True).stdout
    events = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("data: ")]
    assert len(events) > 3 and "".join(e["text_output"] for e in events) == want
    assert all(len(e.get("output_log_probs", [])) <= 1 for e in events) and events[-1]["num_output_tokens"] == 12
    stats = _stats(served.http)
    assert stats["name"] == "ensemble" and stats["inference_stats"]["success"]["count"] == before + 2
    assert stats["inference_stats"]["success"]["ns"] > 0 and stats["last_inference"] > 0


def test_generate_errors_are_tritons_shape(served):
    cases = [({"text_input": "hi"}, 400, "missing required input 'max_tokens'"),
             ({"text_input": "hi", "max_tokens": 4, "wat": 1}, 400, "unknown input 'wat'"),
             ({"text_input": "hi", "max_tokens": "4"}, 400, "max_tokens"),
             ({"text_input": "hi", "max_tokens": 4, "parameters": {"beam_width": 2}}, 400, "beam_width=2")]
    for body, status, message in cases:
        code, reply = post(served.http, "/v2/models/ensemble/generate", body)
        assert code == status and message in reply["error"], (body, reply)
    code, reply = post(served.http, "/v2/models/llama/generate_stream", {"text_input": "hi", "max_tokens": 4})
    assert code == 404 and "unknown model 'llama'" in reply["error"]
    code, reply = post(served.http, "/v2/models/ensemble/generate", {"text_input": "", "max_tokens": 4})
    assert code == 400 and "prompt is empty" in reply["error"]
