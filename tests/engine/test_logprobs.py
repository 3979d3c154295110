"""Logprobs, prompt logprobs (echo), repetition penalty and min_p, checked against Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import sample
from tandem.sampling_params import SamplingParams
from tandem.status import InvalidArgument
from tests.conftest import complete

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def ids(default_engine):
    return default_engine.tokenizer.encode(PROMPT)


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """[len - 1]: transformers' log-probability of each token after the first, given those before it."""
    with torch.inference_mode():
        logits = hf(torch.tensor([token_ids])).logits[0].float()  # [N, V]
    lp = torch.log_softmax(logits[:-1], dim=-1)  # [N - 1, V]
    return lp.gather(1, torch.tensor(token_ids[1:])[:, None]).squeeze(1)


def test_output_and_prompt_logprobs_equal_transformers(default_engine, hf_default_model, ids):
    _, hf = hf_default_model
    seq = complete(default_engine, ids, SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3,
                                                         prompt_logprobs=True))
    want = hf_logprobs(hf, ids + seq.output_ids)  # [P + 6 - 1]
    got_prompt = torch.tensor([r.logprob for r in seq.prompt_logprobs])
    assert len(seq.prompt_logprobs) == len(ids) - 1
    torch.testing.assert_close(got_prompt, want[:len(ids) - 1], atol=2e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(seq.output_logprobs), want[len(ids) - 1:], atol=2e-4, rtol=0)
    top = seq.last_logprob
    assert len(top.top_ids) == 3 and top.top_ids[0] == seq.output_ids[-1]  # greedy: the chosen one leads
    assert list(top.top_logprobs) == sorted(top.top_logprobs, reverse=True)
    assert all(len(r.top_ids) == 3 for r in seq.prompt_logprobs)
    assert default_engine.allocator.num_used == 0


def test_prompt_ranks_agree_with_transformers(default_engine, hf_default_model, ids):
    """Each prompt token's rank (vLLM's: 1 + the tokens strictly more likely) lies within what
    transformers' distribution allows, counting tokens within 1e-3 of it either way; the leader is 1."""
    _, hf = hf_default_model
    seq = complete(default_engine, ids, SamplingParams(max_tokens=1, prompt_logprobs=True, top_logprobs=1))
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)  # [P - 1, V]
    picked = lp.gather(1, torch.tensor(ids[1:])[:, None])  # [P - 1, 1]
    low, high = ((lp > picked + 1e-3).sum(-1) + 1).tolist(), ((lp > picked - 1e-3).sum(-1)).tolist()
    ranks = [r.rank for r in seq.prompt_logprobs]
    assert all(lo <= r <= hi for lo, r, hi in zip(low, ranks, high)), (low, ranks, high)
    assert any(r > 1 for r in ranks) and all((r == 1) == (t == r_.top_ids[0]) for r, t, r_ in
                                             zip(ranks, ids[1:], seq.prompt_logprobs))
    assert seq.output_ids and complete(default_engine, ids, SamplingParams(max_tokens=1, logprobs=True)
                                       ).last_logprob.rank is None  # output reports carry no rank


def test_prompt_logprobs_the_same_when_the_prompt_comes_in_chunks(default_engine, ids):
    whole = complete(default_engine, ids, SamplingParams(max_tokens=2, prompt_logprobs=True))
    seq = default_engine.new_sequence("c", ids, SamplingParams(max_tokens=2, prompt_logprobs=True))
    default_engine.admit(seq)
    done = 0
    for n in (3, 5, len(ids) - 8):
        default_engine.extend([seq], [n])
        done += n
    default_engine.release(seq)
    assert done == len(ids) and seq.output_ids[:1] == whole.output_ids[:1]
    assert [r.logprob for r in seq.prompt_logprobs] == [r.logprob for r in whole.prompt_logprobs]  # bit for bit


def test_repetition_penalty_greedy_equals_transformers(default_engine, hf_default_model, ids):
    from transformers import RepetitionPenaltyLogitsProcessor

    _, hf = hf_default_model
    got = complete(default_engine, ids, SamplingParams(max_tokens=12, repetition_penalty=1.3)).output_ids
    plain = complete(default_engine, ids, SamplingParams(max_tokens=12)).output_ids
    proc, seq = RepetitionPenaltyLogitsProcessor(1.3), list(ids)
    with torch.inference_mode():
        for _ in range(12):
            logits = hf(torch.tensor([seq])).logits[:, -1].float()  # [1, V]
            seq.append(int(proc(torch.tensor([seq]), logits).argmax()))
    assert got == seq[len(ids):]
    assert got != plain  # the penalty changed this answer, so the check above means something


def test_presence_and_frequency_penalties_greedy_equal_a_reference(default_engine, hf_default_model):
    """OpenAI's rule over the output so far: logit -= presence + frequency x count (a prompt the model
    keeps repeating, so the penalties must change the greedy answer)."""
    _, hf = hf_default_model
    ids = default_engine.tokenizer.encode("la la la la la la la la la la la la")
    params = SamplingParams(max_tokens=12, presence_penalty=0.5, frequency_penalty=1.0)
    got = complete(default_engine, ids, params).output_ids
    plain = complete(default_engine, ids, SamplingParams(max_tokens=12)).output_ids
    seq, out = list(ids), []
    with torch.inference_mode():
        for _ in range(12):
            logits = hf(torch.tensor([seq])).logits[0, -1].float()  # [V]
            for t in set(out):
                logits[t] -= 0.5 + 1.0 * out.count(t)
            out.append(int(logits.argmax()))
            seq.append(out[-1])
    assert got == out[:len(got)] and len(got) > 4
    assert got != plain[:len(got)]


def test_logit_bias_greedy_equals_a_reference_and_reports_the_models_own_logprobs(default_engine, hf_default_model,
                                                                                ids):
    """OpenAI's logit_bias: each bias added to its token's logit before choosing (greedy included). The
    answer's first token is banned with -100 and another favoured, so the answer must change; the
    logprobs reported stay the model's own (before the bias)."""
    _, hf = hf_default_model
    plain = complete(default_engine, ids, SamplingParams(max_tokens=8, logprobs=True))
    bias = tuple(sorted({plain.output_ids[0]: -100.0, plain.output_ids[1]: 3.5}.items()))
    got = complete(default_engine, ids, SamplingParams(max_tokens=8, logprobs=True, logit_bias=bias))
    seq, out, own = list(ids), [], []
    with torch.inference_mode():
        for _ in range(8):
            logits = hf(torch.tensor([seq])).logits[0, -1].float()  # [V]
            biased = logits.clone()
            for t, b in bias:
                biased[t] += b
            out.append(int(biased.argmax()))
            own.append(float(torch.log_softmax(logits, -1)[out[-1]]))
            seq.append(out[-1])
    assert got.output_ids == out[:len(got.output_ids)] and len(got.output_ids) > 4
    assert got.output_ids[0] != plain.output_ids[0]
    assert got.output_logprobs == pytest.approx(own[:len(got.output_ids)], abs=1e-3)


def test_min_p_never_samples_below_its_floor():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    drawn = {sample(logits.clone(), [SamplingParams(temperature=1.0, min_p=0.4, seed=s)], [0], [()])[0][0]
             for s in range(200)}
    assert drawn == {0, 1}  # 0.15 < 0.4 * 0.5


def test_seeded_sampling_with_penalty_is_reproducible(default_engine, ids):
    p = SamplingParams(max_tokens=10, temperature=0.8, repetition_penalty=1.2, min_p=0.05, seed=7)
    assert complete(default_engine, ids, p).output_ids == complete(default_engine, ids, p).output_ids


@pytest.mark.parametrize("field,value", [("min_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0.0),
                                         ("presence_penalty", 2.5), ("frequency_penalty", -3),
                                         ("repetition_penalty", float("inf")), ("top_logprobs", 21),
                                         ("top_logprobs", -1)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(InvalidArgument, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("bias", [((5, 100.5),), ((5, float("nan")),), ((5, 1.0), (5, 2.0)), ((7, 1.0), (5, 2.0)),
                                  ((-1, 1.0),), ((5, True),), ((5,),), tuple((t, 1.0) for t in range(1025))])
def test_a_bad_logit_bias_is_refused(bias):
    with pytest.raises(InvalidArgument, match="logit_bias"):
        SamplingParams(logit_bias=bias)

