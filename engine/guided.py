"""Guided decoding: a request's Guide (tandem/guides.py) compiled for one tokenizer, and the state that
says which tokens may come next (llguidance's grammar matcher over the tokenizer's vocabulary).

The state is a pure function of the guide and the tokens generated so far, so it is never sent
anywhere: the prefill worker builds it to sample the first token, the decode worker builds it again
and replays that token, and a worker that resumes a request replays every token already streamed.
Torch-free: the orchestrator checks guides with it; `masks` says, for a batch, which tokens may come next.
llguidance is imported on the first guide, so an engine without it (the device check's) serves the rest.
"""

from __future__ import annotations

import functools
import json
import threading

import numpy as np

from engine.errors import EngineError, InvalidRequest
from tandem.guides import Guide, GuideKind

MAX_ERROR_CHARS = 400
# JSON as `json.dumps` writes it: ", " and ": " between items, no other whitespace. A small model left
# free to add whitespace can spend its whole budget on it; a schema's own "x-guidance" may change this.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuideState:
    """One request's place in its grammar."""

    def __init__(self, matcher):
        """`matcher`: an llguidance.LLMatcher."""
        self._m = matcher

    def advance(self, token: int) -> None:
        """Record a generated token; one the grammar does not allow is the caller's bug (EngineError)."""
        if not self._m.consume_token(token):
            raise EngineError(f"token {token} breaks the request's guide: {self._m.get_error()[:MAX_ERROR_CHARS]}")

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but an end token may follow."""
        return self._m.is_stopped()


def masks(states: list[GuideState], vocab_size: int) -> np.ndarray:
    """[G, vocab_size] uint8: 1 where state g allows token t next, 0 where it does not. The states'
    masks are computed in one call on llguidance's threads (the GIL released), not one by one."""
    from llguidance.numpy import fill_next_token_bitmask_par
    bits = np.full((len(states), (vocab_size + 31) // 32), -1, dtype=np.int32)  # [G, W]: bit t of word t // 32
    fill_next_token_bitmask_par(_executor(), [(s._m, g) for g, s in enumerate(states)], bits)
    return np.unpackbits(bits.view(np.uint8), axis=1, count=vocab_size, bitorder="little")


@functools.cache
def _executor():
    import llguidance
    return llguidance.LLExecutor()


class Guides:
    """Compiles guides for one tokenizer file and vocabulary size; shared by threads (the llguidance
    tokenizer is immutable once built, and built once, on the first guide: ~0.3 s for 49k tokens)."""

    def __init__(self, tokenizer_file: str, vocab_size: int, end_ids):
        self._file, self.vocab_size, self._ends = tokenizer_file, vocab_size, sorted(end_ids)
        self._lock = threading.Lock()
        self._tok = None  # llguidance.LLTokenizer, built by warm() or on the first guide
        self._error: str | None = None  # why it cannot be built, once tried

    def warm(self) -> None:
        """Build the grammar tokenizer now, where a process starts: the build holds the GIL (~0.3 s), and
        on the first guided request it would stall a serving loop. Nothing without llguidance installed
        or with a tokenizer it cannot read (guided requests then say why)."""
        try:
            self._tokenizer()
        except (ImportError, InvalidRequest):
            pass

    def check(self, guide: Guide) -> None:
        """InvalidRequest (naming `guide`) when the schema, regex, grammar or choices do not compile."""
        import llguidance
        error = llguidance.LLMatcher.validate_grammar(_grammar(guide), self._tokenizer())
        if error:
            raise InvalidRequest(f"the {guide.kind} guide does not compile: {error[:MAX_ERROR_CHARS]}")

    def state(self, guide: Guide, outputs: list[int]) -> GuideState:
        """The grammar's state after `outputs` (tokens already generated; a resumed request's)."""
        import llguidance
        matcher = llguidance.LLMatcher(self._tokenizer(), _grammar(guide), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the {guide.kind} guide does not compile: {matcher.get_error()[:MAX_ERROR_CHARS]}")
        state = GuideState(matcher)
        for t in outputs:
            state.advance(t)
        return state

    def _tokenizer(self):
        """llguidance's view of the tokenizer, built once; InvalidRequest (once known, at once) when it
        cannot read this tokenizer (e.g. a vocabulary larger than the model's)."""
        import llguidance
        with self._lock:
            if self._tok is None and self._error is None:
                try:
                    self._tok = llguidance.LLTokenizer(self._file, n_vocab=self.vocab_size, eos_token=self._ends)
                except (ValueError, RuntimeError) as e:
                    self._error = f"structured output is not available with this model's tokenizer: {e}"
            if self._error is not None:
                raise InvalidRequest(self._error[:MAX_ERROR_CHARS])
            return self._tok


@functools.lru_cache(maxsize=8)
def guides_for(tokenizer_file: str, vocab_size: int, end_ids: tuple[int, ...]) -> Guides:
    """The one Guides of a tokenizer file, vocabulary and end tokens in this process (engine and
    orchestrator in one process share its tokenizer)."""
    return Guides(tokenizer_file, vocab_size, end_ids)


@functools.lru_cache(maxsize=256)
def _grammar(guide: Guide) -> str:
    """The guide as an llguidance grammar (text); InvalidRequest when it cannot even be translated."""
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark
    try:
        if guide.kind is GuideKind.JSON:
            return llguidance.LLMatcher.grammar_from_json_schema({}, defaults=_JSON_STYLE)
        if guide.kind is GuideKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(guide.text, defaults=_JSON_STYLE)
        if guide.kind is GuideKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(guide.text)
        if guide.kind is GuideKind.EBNF_GRAMMAR:
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(guide.text))
        # choice: one Lark rule of string literals; JSON string escapes are Lark's too
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in guide.choices))
    except Exception as e:  # the GBNF translator raises bare Exception; llguidance raises ValueError
        raise InvalidRequest(f"the {guide.kind} guide cannot be read: {str(e)[:MAX_ERROR_CHARS]}") from None
