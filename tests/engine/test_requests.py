"""Bad requests get a clear error naming the limit; stop rules end generation where they should."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest, ModelLoadError
from engine.generate import run_generation
from engine.load import load_engine
from tandem.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage
from tests.conftest import complete


def test_empty_prompt(default_engine):
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        default_engine.new_sequence("x", [], SamplingParams())


def test_prompt_longer_than_context(default_engine):
    n = default_engine.max_context
    with pytest.raises(InvalidRequest, match=f"model's context is {n}"):
        default_engine.new_sequence("x", [1] * n, SamplingParams())


def test_prompt_plus_max_tokens_over_context(default_engine):
    n = default_engine.max_context
    with pytest.raises(InvalidRequest, match="ask for at most 10 tokens"):
        default_engine.new_sequence("x", [1] * (n - 10), SamplingParams(max_tokens=11))


def test_token_ids_outside_vocabulary(default_engine):
    with pytest.raises(InvalidRequest, match=r"must be in \[0, 49152\)"):
        default_engine.new_sequence("x", [5, 49152], SamplingParams())


@pytest.mark.parametrize("name, message", [
    ("no-such-model", "unknown model 'no-such-model': expected one of smollm2-135m"),
    ("/nonexistent/folder", "unknown model '/nonexistent/folder'"),
])
def test_unknown_model(name, message):
    with pytest.raises(ModelLoadError, match=message):
        load_engine(name)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_engine(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_engine(str(tmp_path))


def test_stop_string_cuts_the_answer(default_engine):
    ids = default_engine.tokenizer.encode_chat([ChatMessage("user", "What is the capital of France?")])
    full = complete(default_engine, ids, SamplingParams(max_tokens=20))
    text = default_engine.tokenizer.decode(full.output_ids)
    assert "Paris" in text
    cut = complete(default_engine, ids, SamplingParams(max_tokens=20, stop=("Paris",)))
    assert cut.finish_reason.value == "stop" and len(cut.output_ids) < len(full.output_ids)
    assert cut.text.text == text[:text.index("Paris")]


def test_stop_token_and_max_tokens(default_engine):
    ids = default_engine.tokenizer.encode("The quick brown fox")
    full = complete(default_engine, ids, SamplingParams(max_tokens=6))
    assert full.finish_reason.value == "length" and len(full.output_ids) == 6
    stopped = complete(default_engine, ids, SamplingParams(max_tokens=6, stop_token_ids=(full.output_ids[2],)))
    assert stopped.output_ids == full.output_ids[:3] and stopped.finish_reason.value == "stop"
    # run_generation's text leaves out the stop token's, as the front doors do
    text = run_generation(default_engine, ids, SamplingParams(max_tokens=6, stop_token_ids=(full.output_ids[2],))).text
    assert text == default_engine.tokenizer.decode(full.output_ids[:2])
