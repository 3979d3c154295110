"""One request's state inside an engine: its tokens, its KV pages, its sampling and stop rules."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.detokenizer import Decoder, TextStream
from engine.guided import Guides, GuideState
from tandem.logprobs import Logprob
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch stays out of what imports a Sequence
    from engine.lora import LoraAdapter


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client or failed


@dataclass(eq=False)  # identity: two requests are never "equal"
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    max_context: int
    page_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading tokens whose K/V are already in pages
    page_hashes: list[bytes] = field(default_factory=list)  # prefix-cache names of its full pages so far
    committed: int = 0  # leading pages already named in the pool's prefix cache (engine/prefix_cache.py)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    last_logprob: Logprob | None = None  # the newest token's report, with its alternatives (if asked)
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # prompt tokens 1.. (params.prompt_logprobs)
    finish_reason: FinishReason | None = None
    text: TextStream | None = None  # only when there are stop strings to find
    guide: GuideState | None = None  # only when the params carry a guide: which tokens may come next
    adapter: LoraAdapter | None = None  # params.lora's, held from admission on: unloading it spares this request

    def attach_text(self, tokenizer: Decoder) -> None:
        if self.params.stop:
            self.text = TextStream(tokenizer, self.params.stop)
            for t in self.output_ids:  # earlier outputs of a resumed request
                self.text.add(t)

    def attach_guide(self, guides: Guides) -> None:
        """Follow the params' guide from the tokens generated so far (those of a resumed request)."""
        if self.params.guide is not None:
            self.guide = guides.state(self.params.guide, self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def budget(self) -> int:
        """Tokens this request may hold in the KV pool at most: prompt + outputs, within the context."""
        return min(len(self.prompt_ids) + self.params.max_tokens, self.max_context)

    @property
    def top_report(self) -> Logprob | None:
        """The newest token's report when it carries alternatives (top_logprobs asked), else None."""
        return self.last_logprob if self.last_logprob is not None and self.last_logprob.top_ids else None

    def banned_ids(self) -> tuple[int, ...]:
        """Tokens that may not be sampled now: stop tokens before min_tokens outputs exist, and the last
        token of each bad word whose other tokens the output ends with (a one-token word: always)."""
        out = self.output_ids
        if not self.params.bad_words and len(out) >= self.params.min_tokens:
            return ()  # the common case, every step of every sequence: nothing to build
        ban = {w[-1] for w in self.params.bad_words if len(w) == 1 or (len(w) - 1 <= len(out) and
                                                                        tuple(out[len(out) - len(w) + 1:]) == w[:-1])}
        if len(out) < self.params.min_tokens:
            ban |= self.eos_ids | set(self.params.stop_token_ids)
        return tuple(sorted(ban))

    def append(self, token: int, logprob: float | Logprob | None) -> None:
        """Record one generated token and decide whether the request is finished."""
        self.output_ids.append(token)
        self.last_logprob = logprob if isinstance(logprob, Logprob) else None
        if logprob is not None:
            self.output_logprobs.append(logprob.logprob if isinstance(logprob, Logprob) else logprob)
        p = self.params
        if self.guide is not None:
            self.guide.advance(token)
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self.finish_reason = FinishReason.STOP
            return
        if self.text is not None:
            self.text.add(token)
            if self.text.stopped:
                self.finish_reason = FinishReason.STOP
                return
        if self.guide is not None and self.guide.finished:  # the grammar is complete: only an end could follow
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= p.max_tokens or self.num_tokens >= self.max_context:
            self.finish_reason = FinishReason.LENGTH
