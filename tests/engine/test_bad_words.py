"""Bad words in the engine: a banned token sequence never appears in the output, only its last token
is banned and only where the output ends with the rest, and a resumed request continues exactly."""

from __future__ import annotations

import pytest

from tandem.sampling_params import MAX_BAD_WORDS, SamplingParams
from tandem.status import InvalidArgument
from tests.conftest import complete

PROMPT = "The capital of France is"


def _contains(ids: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(ids[i:i + len(word)]) == word for i in range(len(ids) - len(word) + 1))


@pytest.fixture(scope="module")
def free(default_engine):
    ids = default_engine.tokenizer.encode(PROMPT)
    return ids, complete(default_engine, ids, SamplingParams(max_tokens=16)).output_ids


def test_a_one_token_word_is_never_sampled(default_engine, free):
    ids, out = free
    word = (out[0],)
    got = complete(default_engine, ids, SamplingParams(max_tokens=16, bad_words=(word,))).output_ids
    assert not _contains(got, word) and got[0] != out[0]


def test_a_longer_word_bans_its_last_token_only_after_the_rest(default_engine, free):
    ids, out = free
    word = tuple(out[2:4])
    got = complete(default_engine, ids, SamplingParams(max_tokens=16, bad_words=(word,))).output_ids
    assert got[:3] == out[:3] and got[3] != out[3] and not _contains(got, word)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_resumed_request_with_bad_words_continues_exactly(default_engine, free, temperature):
    ids, out = free
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=5, bad_words=((out[0],), tuple(out[2:4])))
    whole = complete(default_engine, ids, params).output_ids
    for k in (1, 8):
        seq = default_engine.new_sequence("resumed", ids, params, output_ids=whole[:k])
        default_engine.admit(seq)
        default_engine.prefill([seq])
        while not seq.finished:
            default_engine.decode_step([seq])
        default_engine.release(seq)
        assert seq.output_ids == whole, k


@pytest.mark.parametrize("words", [((),), ((1,) * 17,), ((-1,),), ((1,),) * (MAX_BAD_WORDS + 1)])
def test_malformed_bad_words_are_refused(words):
    with pytest.raises(InvalidArgument, match="bad_words"):
        SamplingParams(bad_words=words)
