"""OpenAI's logprobs objects, built token by token from the orchestrator's deltas.

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each top_logprobs
entry maps token text to logprob (the chosen token always included, so up to logprobs+1 entries) and
an echoed prompt's first token has logprob null (nothing predicts it). Chat: `{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}`. vLLM's
`prompt_logprobs` (both endpoints): `[null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]`,
one object per prompt token, its own entry first and then its alternatives.
A token's text is that token decoded alone (special tokens kept), as vLLM reports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.logprobs import Logprob


@dataclass(frozen=True)
class Shown:
    """The logprobs a reply shows: `top` alternatives per token (the engine may report more, for
    `prompt_logprobs`), vLLM's `prompt_logprobs` (k alternatives; None: not asked) and whether the echoed
    prompt's tokens are among the answer's logprobs (completions' echo with logprobs)."""

    top: int = 0
    prompt_logprobs: int | None = None
    echo: bool = False


class LogprobTrail:
    """Collects per-token reports; `take()` hands out the object for those collected since the last take
    (None if the request did not ask for logprobs), `prompt` is vLLM's prompt_logprobs once they came."""

    def __init__(self, chat: bool, decode_one: Callable[[int], str], logprobs: bool, shown: Shown):
        self.chat, self.decode_one, self.logprobs, self.shown, self.offset = chat, decode_one, logprobs, shown, 0
        self.entries: list[tuple[int, float | None, Logprob | None]] = []  # (token, logprob, alternatives)
        self.prompt: list[dict | None] | None = None

    def add(self, delta) -> None:
        """One frontdoor.core.Delta: the prompt's reports first (they come with the first delta, beside the
        prompt's ids; the prompt's first token has no logprob), then the delta's own token."""
        if delta.prompt_logprobs:
            ids = delta.prompt_ids
            if self.shown.echo:
                self.entries.append((ids[0], None, None))
                self.entries.extend((t, r.logprob, r) for t, r in zip(ids[1:], delta.prompt_logprobs))
            if self.shown.prompt_logprobs is not None:
                self.prompt = [None, *(self._scored(t, r) for t, r in zip(ids[1:], delta.prompt_logprobs))]
        if delta.token is not None and delta.logprob is not None:
            self.entries.append((delta.token, delta.logprob, delta.top))

    def take(self) -> dict | None:
        entries, self.entries = self.entries, []
        if not self.logprobs:
            return None
        return self._chat(entries) if self.chat else self._completion(entries)

    def _scored(self, token: int, r: Logprob) -> dict:
        """vLLM's report of one prompt token: {id: {"logprob", "rank", "decoded_token"}} for the token
        itself, then its top alternatives (rank 1 first); the token is not repeated among them."""
        out = {str(token): {"logprob": r.logprob, "rank": r.rank, "decoded_token": self.decode_one(token)}}
        k = self.shown.prompt_logprobs
        for i, (t, v) in enumerate(zip(r.top_ids[:k], r.top_logprobs[:k])):
            out.setdefault(str(t), {"logprob": v, "rank": i + 1, "decoded_token": self.decode_one(t)})
        return out

    def _alternatives(self, top: Logprob | None) -> list[tuple[int, float]]:
        """The (id, logprob) alternatives the reply shows of a report (the engine may report more)."""
        if top is None:
            return []
        return list(zip(top.top_ids[:self.shown.top], top.top_logprobs[:self.shown.top]))

    def _chat(self, entries) -> dict:
        content = []
        for token, lp, top in entries:
            alts = [self._chat_entry(t, v) for t, v in self._alternatives(top)]
            content.append(self._chat_entry(token, lp) | {"top_logprobs": alts})
        return {"content": content, "refusal": None}

    def _chat_entry(self, token: int, lp: float) -> dict:
        text = self.decode_one(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    def _completion(self, entries) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for token, lp, top in entries:
            text = self.decode_one(token)
            tokens.append(text)
            lps.append(lp)
            offsets.append(self.offset)
            self.offset += len(text)
            alts = {self.decode_one(t): v for t, v in self._alternatives(top)}
            tops.append(None if lp is None else alts | {text: lp})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
