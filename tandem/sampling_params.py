"""What to generate: the per-request sampling parameters, validated once, where they are made.

The sampler itself (torch) lives in engine/sampler.py; this module imports nothing heavy, so the
front doors can build and check parameters without torch.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace

from tandem.guides import Guide
from tandem.status import InvalidArgument

MAX_STOP_STRINGS = 16
MAX_SEED = 2**64
MAX_TOP_LOGPROBS = 20  # alternatives per position, as OpenAI allows
MAX_LOGIT_BIAS = 1024  # tokens one request may bias: the sampler adds each to its logit at every step
MAX_BAD_WORDS = 64  # token sequences one request may ban (engine/sequence.py checks each at every step)
MAX_BAD_WORD_TOKENS = 16
MAX_CACHE_SALT = 256  # characters of a request's cache_salt
MAX_PRIORITY = 2**31 - 1  # |priority| (vLLM takes any integer; a 32-bit one is every scheduler's)
MAX_LORA_NAME = 160  # characters of a LoRA adapter's key: its name (at most 128) and a load's suffix


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation.

    Constructing one validates it (InvalidArgument naming the field), so a SamplingParams that exists
    is a valid one: a worker that receives it on the wire rebuilds it and trusts it.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives reported per token (output tokens with logprobs; prompt tokens with ...
    prompt_logprobs: bool = False  # ... this: the logprob and rank of every prompt token after the first)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0 = off)
    repetition_penalty: float = 1.0  # >1 discourages tokens already in the prompt or output (1 = off)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output (OpenAI)
    frequency_penalty: float = 0.0  # ... times how often it is there
    extra_eos: tuple[int, ...] = ()  # e.g. a client's end_id, on top of the model's EOS
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by id, each id once
    guide: Guide | None = None  # the grammar the output follows (tandem/guides.py); None: free text
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output never contains (their last token
    # is banned where the output ends with the rest)
    allowed_token_ids: tuple[int, ...] = ()  # the only tokens the output may hold, distinct; () = any
    cache_salt: str = ""  # prefix-cache pages are shared only among requests with the same one (tandem/prefix.py)
    lora: str = ""  # the LoRA adapter the answer is computed with (engine/lora.py); "": the base model
    priority: int = 0  # waiting for a pass, lower goes first, arrival order among equals (vLLM's); changes no token

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}", "temperature")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidArgument(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}", "top_k")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgument(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
                                  "min_tokens")
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidArgument(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings, got {list(self.stop)!r}",
                                  "stop")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise InvalidArgument(f"seed must be an integer in [0, 2**64), got {self.seed!r}", "seed")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}", "min_p")
        if not isinstance(self.repetition_penalty, (int, float)) or not math.isfinite(self.repetition_penalty) \
                or not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidArgument(f"repetition_penalty must be in (0, 10] (1 = off), got {self.repetition_penalty!r}",
                                  "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise InvalidArgument(f"{name} must be in [-2, 2] (0 = off), got {v!r}", name)
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                                  f"{self.top_logprobs!r}", "top_logprobs")
        for name in ("stop_token_ids", "extra_eos"):
            if any(not _is_int(t) or t < 0 for t in getattr(self, name)):
                raise InvalidArgument(f"{name} must be non-negative token ids", name)
        _check_logit_bias(self.logit_bias)
        _check_bad_words(self.bad_words)
        allowed = self.allowed_token_ids
        if any(not _is_int(t) or t < 0 for t in allowed) or len(set(allowed)) != len(allowed):
            raise InvalidArgument("allowed_token_ids must be distinct non-negative token ids", "allowed_token_ids")
        if allowed and self.guide is not None:
            raise InvalidArgument("allowed_token_ids and structured output exclude each other (the grammar already "
                                  "says which tokens may come): send one of them", "allowed_token_ids")
        if not _is_int(self.priority) or not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise InvalidArgument(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}] (lower is served "
                                  f"first), got {self.priority!r}", "priority")
        if not isinstance(self.lora, str) or len(self.lora) > MAX_LORA_NAME:
            raise InvalidArgument(f"lora must be an adapter's key of at most {MAX_LORA_NAME} characters", "lora")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT:
            raise InvalidArgument(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters", "cache_salt")
        if self.guide is not None and not isinstance(self.guide, Guide):
            raise InvalidArgument(f"guide must be a Guide or None, got {type(self.guide).__name__}", "guide")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def edits_logits(self) -> bool:
        """True when sampling changes the model's logits before choosing (penalties, a logit bias, a guide,
        a list of allowed tokens)."""
        return self.penalized or bool(self.logit_bias) or self.guide is not None or bool(self.allowed_token_ids)

    @property
    def penalized(self) -> bool:
        """True when sampling reads the request's tokens so far (a repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed, so every process that samples for this request agrees."""
        return self if self.seed is not None or self.greedy else replace(self, seed=secrets.randbits(63))


def _check_logit_bias(bias) -> None:
    """(token id, bias) pairs in increasing id order, at most MAX_LOGIT_BIAS, each bias in [-100, 100]."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
    last = -1
    for pair in bias:
        if len(pair) != 2 or not _is_int(pair[0]) or pair[0] <= last:
            raise InvalidArgument("logit_bias must map distinct non-negative token ids to biases", "logit_bias")
        if isinstance(pair[1], bool) or not isinstance(pair[1], (int, float)) or not -100.0 <= pair[1] <= 100.0:
            raise InvalidArgument(f"logit_bias for token {pair[0]} must be a number in [-100, 100], got {pair[1]!r}",
                                  "logit_bias")
        last = pair[0]


def _check_bad_words(words) -> None:
    """At most MAX_BAD_WORDS token sequences of 1..MAX_BAD_WORD_TOKENS non-negative ids."""
    ok = len(words) <= MAX_BAD_WORDS and all(1 <= len(w) <= MAX_BAD_WORD_TOKENS and all(_is_int(t) and t >= 0 for t in w)
                                             for w in words)
    if not ok:
        raise InvalidArgument(f"bad_words takes at most {MAX_BAD_WORDS} words of 1..{MAX_BAD_WORD_TOKENS} tokens each",
                              "bad_words")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
