"""The engine runs in bf16 and fp16 too (fp32 stays the default and the exactness reference)."""

from __future__ import annotations

import pytest

from engine.load import load_engine
from tandem.sampling_params import SamplingParams


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engines_answer_sensibly(dtype):
    engine = load_engine("smollm2-135m", dtype=dtype, kv_bytes=32 << 20)
    assert engine.cache.layout.dtype == dtype and engine.cache.data.element_size() == 2
    seq = engine.new_sequence("h", engine.tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=4))
    engine.admit(seq)
    engine.prefill([seq])
    while not seq.finished:
        engine.decode_step([seq])
    engine.release(seq)
    assert "Paris" in engine.tokenizer.decode(seq.output_ids)


def test_bfloat16_perplexity_stays_near_float32():
    """bf16 weights and activations (the CPU serving option) lose little: perplexity on a plain English
    text within 3% of fp32's."""
    from engine.evaluate import perplexity

    text = ("The river carried silt from the mountains to the delta, where farmers planted rice and traders "
            "met at the market every few days. In the dry season the water fell, and the children walked "
            "across the sandbanks to the villages on the other side to sell fish and buy cloth.")
    ppl = {}
    for dtype in ("float32", "bfloat16"):
        engine = load_engine("smollm2-135m", dtype=dtype, kv_bytes=None)
        ppl[dtype] = perplexity(engine.model, engine.tokenizer.encode(text))
    assert ppl["float32"] < 100  # the reference itself reads the text as English
    assert abs(ppl["bfloat16"] / ppl["float32"] - 1) < 0.03, ppl


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels-where-they-apply", "without-kernels"])
def test_a_bf16_layer_loads_and_multiplies_on_any_cpu(kernels, monkeypatch):
    """Without Tandem's kernels a bf16 layer goes to oneDNN only where oneDNN has bf16 instructions (an
    AVX2-only CPU has none: its weight reorder raised there, and no bf16 engine loaded), else PyTorch's."""
    import torch

    from engine.cpu_kernels import gemv as cpu_gemv
    from engine.cpu_kernels.gemv import onednn_takes
    from engine.linear import Dense

    if not kernels:
        monkeypatch.setattr(cpu_gemv, "supports", lambda w: False)
    torch.manual_seed(0)
    w, x = torch.randn(64, 48).bfloat16(), torch.randn(5, 48).bfloat16()
    layer = Dense(w)
    assert kernels or layer._onednn == onednn_takes(torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), (x.double() @ w.double().T).float(), rtol=2 ** -6, atol=0.05)
