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
