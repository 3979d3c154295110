"""Sampling: seeds reproducible whatever the batch, truncation rules, logprobs, parameter checks."""

from __future__ import annotations

import pytest
import torch

from tandem.status import InvalidArgument
from engine.sampler import sample
from tandem.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage

PROMPT = "Tell me a short story about a robot."


def generate(engine, prompts, params_list):
    seqs = [engine.new_sequence(f"s{i}", p, prm) for i, (p, prm) in enumerate(zip(prompts, params_list))]
    for s in seqs:
        engine.admit(s)
    engine.prefill(seqs)
    while any(not s.finished for s in seqs):
        engine.decode_step([s for s in seqs if not s.finished])
    for s in seqs:
        engine.release(s)
    return seqs


@pytest.fixture(scope="module")
def ids(default_engine):
    return default_engine.tokenizer.encode_chat([ChatMessage("user", PROMPT)])


def test_seed_reproducible_alone_and_in_a_batch(default_engine, ids):
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    alone = generate(default_engine, [ids], [p])[0].output_ids
    others = [default_engine.tokenizer.encode(t) for t in ("Once upon a time", "The weather", "def main():")]
    batch = generate(default_engine, others[:2] + [ids] + others[2:],
                     [SamplingParams(max_tokens=20, temperature=1.0, seed=9)] * 2 + [p]
                     + [SamplingParams(max_tokens=5)])
    assert batch[2].output_ids == alone
    again = generate(default_engine, [ids], [p])[0].output_ids
    assert again == alone


def test_different_seeds_give_different_samples(default_engine, ids):
    outs = {tuple(generate(default_engine, [ids], [SamplingParams(max_tokens=16, temperature=1.0, seed=s)])[0].output_ids)
            for s in range(4)}
    assert len(outs) > 1


def test_top_k_1_and_tiny_top_p_equal_greedy(default_engine, ids):
    greedy = generate(default_engine, [ids], [SamplingParams(max_tokens=12)])[0].output_ids
    k1 = generate(default_engine, [ids], [SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3)])[0]
    p0 = generate(default_engine, [ids], [SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=3)])[0]
    assert k1.output_ids == greedy and p0.output_ids == greedy


def test_top_k_and_top_p_never_sample_outside_their_set():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    drawn_k = {sample(logits.clone(), [SamplingParams(temperature=5.0, top_k=2, seed=s)], [0], [()])[0][0]
               for s in range(200)}
    assert drawn_k == {0, 1}
    probs = torch.softmax(logits[0], -1)  # top two hold 0.64 + 0.24 of the mass
    drawn_p = {sample(logits.clone(), [SamplingParams(temperature=1.0, top_p=0.8, seed=s)], [0], [()])[0][0]
               for s in range(300)}
    assert float(probs[0]) < 0.8 <= float(probs[:2].sum()) and drawn_p == {0, 1}


def test_greedy_takes_the_first_of_tied_maxima_in_every_row():
    """As transformers' argmax does: a tie goes to the lower token id, in a batch as alone."""
    logits = torch.zeros(3, 49152)
    logits[0, [9, 4, 40000]] = 7.0
    logits[1, [48000, 48001]] = 2.0
    logits[2, 12345] = 1.0
    tokens, _ = sample(logits, [SamplingParams()] * 3, [0] * 3, [()] * 3)
    assert tokens == [4, 48000, 12345]
    assert sample(logits[:1], [SamplingParams()], [0], [()])[0] == [4]


def test_banned_tokens_are_never_chosen():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    tokens, _ = sample(logits, [SamplingParams()], [0], [(0,)])
    assert tokens == [1]


def test_only_allowed_tokens_are_chosen_and_a_ban_never_takes_the_last_of_them():
    logits = torch.tensor([[9.0, 1.0, 3.0, 2.0, 0.0]])
    allowed = SamplingParams(allowed_token_ids=(1, 3, 4))
    assert sample(logits.clone(), [allowed], [0], [()])[0] == [3]  # greedy: the best allowed one
    drawn = {sample(logits.clone(), [SamplingParams(temperature=5.0, seed=s, allowed_token_ids=(1, 3, 4))], [0],
                    [()])[0][0] for s in range(200)}
    assert drawn == {1, 3, 4}
    assert sample(logits.clone(), [allowed], [0], [(3,)])[0] == [1]  # a ban (min_tokens' EOS) still applies ...
    assert sample(logits.clone(), [allowed], [0], [(1, 3, 4)])[0] == [3]  # ... unless it would leave nothing
    _, lps = sample(logits.clone(), [SamplingParams(logprobs=True, allowed_token_ids=(1, 3, 4))], [0], [()])
    assert lps[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[3]))  # the model's own logprob


def test_logprobs_equal_transformers_log_softmax(default_engine, hf_default_model, ids):
    seq = generate(default_engine, [ids], [SamplingParams(max_tokens=8, logprobs=True)])[0]
    _, hf = hf_default_model
    full = torch.tensor([ids + seq.output_ids])
    with torch.inference_mode():
        logp = torch.log_softmax(hf(full).logits[0].float(), -1)  # [S, V]
    want = [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(seq.output_ids)]
    assert seq.output_logprobs == pytest.approx(want, abs=1e-4)


def test_min_tokens_suppresses_eos(default_engine):
    prompt = default_engine.tokenizer.encode_chat([ChatMessage("user", "What is the capital of France?")])
    short = generate(default_engine, [prompt], [SamplingParams(max_tokens=40)])[0]
    assert short.finish_reason.value == "stop" and len(short.output_ids) < 20
    forced = generate(default_engine, [prompt], [SamplingParams(max_tokens=25, min_tokens=25)])[0]
    assert len(forced.output_ids) == 25 and forced.finish_reason.value == "length"


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens must be in [0, max_tokens=2]"),
    (dict(stop=("",)), "non-empty strings"),
    (dict(seed=-1), "seed must be an integer in"),
    (dict(allowed_token_ids=(3, 3)), "distinct non-negative"),
])
def test_bad_parameters_are_refused_with_the_limit(kwargs, message):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)
