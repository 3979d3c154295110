"""Greedy output equals Hugging Face transformers token for token, prompt ids included."""

from __future__ import annotations

import json

import pytest
import torch

from engine.engine import Engine
from engine.kv_pool import KVCache
from engine.load import load_engine
from tandem.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage

LONG_TEXT = " ".join(
    f"Paragraph {i}: the river carried silt from the mountains to the delta, where farmers planted rice "
    f"and traders met at the market every {i + 2} days." for i in range(10))
CHAT_PROMPTS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 100.",
    "Explain in one sentence why the sky is blue.",
    "Translate 'good morning' into Spanish and German.",
    "What is 12 times 7? Answer with the number only.",
    f"Summarize this text in two sentences:\n{LONG_TEXT}",
]
RAW_PROMPTS = ["Hello", "The quick brown fox"]  # no chat template: 1 and 4 tokens
MAX_TOKENS = 24


def hf_greedy(model, ids: list[int], max_tokens: int, eos: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def run_staggered(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Prefill the first half packed, decode a few steps, then prefill the rest so they join mid-way."""
    seqs = [engine.new_sequence(f"r{i}", p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    half = len(seqs) // 2
    running = []
    for group in (seqs[:half], seqs[half:]):
        for s in group:
            engine.admit(s)
        engine.prefill(group)
        running += [s for s in group if not s.finished]
        for _ in range(3 if group is seqs[:half] else max_tokens):
            running = [s for s in running if not s.finished]
            if not running:
                break
            engine.decode_step(running)
    for s in seqs:
        engine.release(s)
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def prompt_ids(default_engine, hf_default_model):
    hf_tok, _ = hf_default_model
    ours = [default_engine.tokenizer.encode_chat([ChatMessage("user", p)]) for p in CHAT_PROMPTS]
    ours += [default_engine.tokenizer.encode(p) for p in RAW_PROMPTS]
    theirs = [hf_tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"] for p in CHAT_PROMPTS]
    theirs += [hf_tok(p)["input_ids"] for p in RAW_PROMPTS]
    assert ours == theirs
    return ours


def test_prompt_lengths_span_short_to_long(prompt_ids):
    lengths = sorted(len(p) for p in prompt_ids)
    assert lengths[0] == 1 and lengths[-1] >= 300, lengths


def test_greedy_matches_transformers_batched_with_late_joiners(default_engine, hf_default_model, prompt_ids):
    _, hf = hf_default_model
    expected = [hf_greedy(hf, p, MAX_TOKENS, eos=2) for p in prompt_ids]
    got = run_staggered(default_engine, prompt_ids, MAX_TOKENS)
    for p, e, g in zip(prompt_ids, expected, got):
        assert g == e, f"prompt of {len(p)} tokens diverged"
    assert default_engine.allocator.num_used == 0


def test_pages_copied_to_another_instance_decode_identically(default_engine, prompt_ids):
    """Prefill in one engine, copy the pages into different page ids of a second engine's shared-memory
    pool, and decode there: the tokens equal decoding in the first engine."""
    prompts = prompt_ids[:4]
    reference = run_staggered(default_engine, prompts, 12)
    other = Engine(default_engine.model, default_engine.tokenizer,
                   KVCache(default_engine.cache.layout, 64, shared=True))
    try:
        other.allocator.allocate(5)  # so the copies land in different page ids than in the source
        for prompt, want in zip(prompts, reference):
            src = default_engine.new_sequence("a", prompt, SamplingParams(max_tokens=12))
            default_engine.admit(src)
            default_engine.prefill([src])
            dst = other.new_sequence("a", prompt, SamplingParams(max_tokens=12))
            other.admit(dst)
            assert dst.page_table != src.page_table
            other.cache.load_pages(dst.page_table, default_engine.cache.pages(src.page_table))
            dst.output_ids, dst.num_cached = list(src.output_ids), src.num_cached
            default_engine.release(src)
            while not dst.finished:
                other.decode_step([dst])
            other.release(dst)
            assert dst.output_ids == want
    finally:
        other.cache.close()


RANDOM_LLAMAS = {
    "llama3-scaling-gqa-untied": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                      max_position_embeddings=512),
    "linear-scaling-bias": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True,
                                max_position_embeddings=256),
    "dynamic-scaling-past-original": dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0},
                                          max_position_embeddings=48),
}


def make_random_llama(folder, **overrides) -> None:
    """A small random Llama saved as a Hugging Face folder, with a word-level tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, initializer_range=0.25,
               rope_theta=10000.0, bos_token_id=0, eos_token_id=1)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    model.save_pretrained(folder, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    return model


@pytest.mark.parametrize("variant", list(RANDOM_LLAMAS))
def test_random_llama_matches_transformers(tmp_path, variant):
    hf = make_random_llama(tmp_path, **RANDOM_LLAMAS[variant]).eval()
    engine = load_engine(str(tmp_path), kv_bytes=8 << 20)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (1, 5, 37, 70)]
    max_tokens = 20
    expected = [hf_greedy(hf, p, max_tokens, eos=1) for p in prompts]
    assert run_staggered(engine, prompts, max_tokens) == expected
