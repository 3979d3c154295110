"""On a CUDA device: the same greedy tokens as transformers in fp32, and sensible output in bf16."""

from __future__ import annotations

import pytest
import torch

from engine.load import load_engine
from tandem.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from tests.conftest import complete
from tests.engine.test_exactness import CHAT_PROMPTS

pytestmark = pytest.mark.gpu


def test_fp32_on_cuda_matches_transformers(hf_default_model):
    engine = load_engine("smollm2-135m", device="cuda", kv_bytes=128 << 20)
    tok, hf = hf_default_model
    hf = hf.to("cuda")
    for p in CHAT_PROMPTS[:4]:
        ids = engine.tokenizer.encode_chat([ChatMessage("user", p)])
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24, do_sample=False,
                              eos_token_id=2, pad_token_id=2)
        assert complete(engine, ids, SamplingParams(max_tokens=24)).output_ids == out[0, len(ids):].tolist()
    hf.to("cpu")


def test_bf16_on_cuda_answers_sensibly():
    engine = load_engine("smollm2-135m", device="cuda", dtype="bfloat16", kv_bytes=64 << 20)
    seq = complete(engine, engine.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=4))
    assert "Paris" in engine.tokenizer.decode(seq.output_ids)
