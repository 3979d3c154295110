"""Structured output in the engine (engine/guided.py): every guide kind holds on the real model, greedy
and sampled; a request resumed after any number of tokens (decode taking over from prefill's first
token, or a worker taking over a dead one's stream) continues with exactly its own tokens; and guides
that do not compile are refused, naming what is wrong."""

from __future__ import annotations

import json
import re

import pytest

from engine.errors import InvalidRequest
from engine.guided import guides_for
from engine.tokenizer import ChatMessage
from tandem.guides import MAX_GUIDE_CHARS, Guide, GuideKind
from tandem.sampling_params import SamplingParams
from tandem.status import InvalidArgument
from tests.conftest import complete

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                          "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
          "required": ["city", "population"], "additionalProperties": False}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CITIES = ["Paris", "Lyon", "Marseille", "New York"]
YES_NO = 'root ::= answer "."\nanswer ::= "yes" | "no"'


def _holds(guide: Guide, text: str) -> bool:
    """Whether `text` is an output the guide allows (checked independently of the grammar engine)."""
    if guide.kind is GuideKind.JSON:
        json.loads(text)
        return True
    if guide.kind is GuideKind.JSON_SCHEMA:
        v = json.loads(text)
        return isinstance(v["city"], str) and len(v["city"]) <= 40 and 0 <= v["population"] <= 10**8 \
            and isinstance(v["population"], int) and set(v) == {"city", "population"}
    if guide.kind is GuideKind.REGEX:
        return re.fullmatch(PHONE, text) is not None
    if guide.kind is GuideKind.CHOICE:
        return text in CITIES
    return text in ("yes.", "no.")


GUIDES = [Guide(GuideKind.JSON), Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA)), Guide(GuideKind.REGEX, PHONE),
          Guide(GuideKind.CHOICE, json.dumps(CITIES)), Guide(GuideKind.EBNF_GRAMMAR, YES_NO)]


@pytest.fixture(scope="module")
def prompt(default_engine):
    return default_engine.tokenizer.encode_chat([ChatMessage("user", "Which city is the capital of France, and how "
                                                                     "many people live there?")])


def test_free_text_is_not_what_the_guides_ask_for(default_engine, prompt):
    """The control: unguided, the model answers in prose, so the guides below change the answer."""
    text = default_engine.tokenizer.decode(complete(default_engine, prompt, SamplingParams(max_tokens=24)).output_ids)
    with pytest.raises(ValueError):
        json.loads(text)
    assert text not in CITIES and re.fullmatch(PHONE, text) is None


@pytest.mark.parametrize("guide", GUIDES, ids=lambda g: g.kind.value)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_guide_holds_and_a_resumed_request_continues_exactly(default_engine, prompt, guide, temperature):
    params = SamplingParams(max_tokens=48, temperature=temperature, top_p=0.95, seed=11, guide=guide)
    whole = complete(default_engine, prompt, params)
    text = default_engine.tokenizer.decode(whole.output_ids)
    assert _holds(guide, text), text
    # any JSON value may be a number the model never ends: cut at max_tokens, it is still JSON
    assert whole.finish_reason.value == "stop" or guide.kind is GuideKind.JSON
    n = len(whole.output_ids)
    for k in sorted({1, n // 2, n - 1} - {0, n}):  # taken over after k tokens: the rest is the same
        seq = default_engine.new_sequence("resumed", prompt, params, output_ids=whole.output_ids[:k])
        default_engine.admit(seq)
        default_engine.prefill([seq])
        while not seq.finished:
            default_engine.decode_step([seq])
        default_engine.release(seq)
        assert seq.output_ids == whole.output_ids, k


def test_a_guided_row_batched_with_free_rows_changes_only_itself(default_engine, prompt):
    free = SamplingParams(max_tokens=12)
    guided = SamplingParams(max_tokens=12, guide=GUIDES[2])
    alone = [complete(default_engine, prompt, p).output_ids for p in (free, guided)]
    seqs = [default_engine.new_sequence(f"r{i}", prompt, p) for i, p in enumerate((free, guided))]
    for s in seqs:
        default_engine.admit(s)
    default_engine.prefill(seqs)
    while not all(s.finished for s in seqs):
        default_engine.decode_step([s for s in seqs if not s.finished])
    for s in seqs:
        default_engine.release(s)
    assert [s.output_ids for s in seqs] == alone


def test_a_complete_grammar_ends_the_answer_even_where_end_tokens_are_ignored(default_engine, prompt):
    for params in (SamplingParams(max_tokens=20, ignore_eos=True, guide=GUIDES[3]),
                   SamplingParams(max_tokens=20, min_tokens=10, guide=GUIDES[3])):
        seq = complete(default_engine, prompt, params)
        assert default_engine.tokenizer.decode(seq.output_ids) in CITIES and seq.finish_reason.value == "stop"


@pytest.mark.parametrize("kind, text, why", [
    (GuideKind.REGEX, r"(\d+", "unclosed group"),
    (GuideKind.EBNF_GRAMMAR, "answer ::= \"yes\"", "root"),
    (GuideKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "nonsense"),
])
def test_a_guide_that_does_not_compile_is_refused_naming_why(default_engine, kind, text, why):
    guides = guides_for(default_engine.tokenizer.file, default_engine.cfg.vocab_size,
                        tuple(sorted(default_engine.eos_ids)))
    with pytest.raises(InvalidRequest, match=f"(?s)(does not compile|cannot be read).*{why}"):
        guides.check(Guide(kind, text))
    with pytest.raises(InvalidRequest):
        default_engine.new_sequence("bad", [1, 2, 3], SamplingParams(guide=Guide(kind, text)))


@pytest.mark.parametrize("kind, text, why", [
    (GuideKind.JSON, "{}", "takes no text"), (GuideKind.JSON_SCHEMA, "[1]", "JSON object"),
    (GuideKind.JSON_SCHEMA, "{", "not valid JSON"), (GuideKind.REGEX, "", "needs its text"),
    (GuideKind.CHOICE, json.dumps(["a", ""]), "non-empty strings"), (GuideKind.CHOICE, "[]", "non-empty strings"),
    (GuideKind.REGEX, "a" * (MAX_GUIDE_CHARS + 1), "at most"), ("xml", "<a/>", "must be one of"),
])
def test_a_malformed_guide_is_refused_where_it_is_made(kind, text, why):
    with pytest.raises(InvalidArgument, match=why):
        Guide(kind, text)


def test_a_tokenizer_llguidance_cannot_read_leaves_the_engine_up_and_guides_refused(default_engine):
    from engine.guided import Guides
    guides = Guides(default_engine.tokenizer.file, 1000, (2,))  # a vocabulary smaller than the tokenizer's
    guides.warm()  # where an engine starts: no error, unguided requests are served as ever
    for _ in range(2):  # the reason is kept, not rebuilt each time
        with pytest.raises(InvalidRequest, match="structured output is not available.*vocab size too small"):
            guides.check(Guide(GuideKind.REGEX, "[0-9]+"))
