"""OpenAI's logprobs objects, built token by token from the orchestrator's deltas.

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each top_logprobs
entry maps token text to logprob (the chosen token always included, so up to logprobs+1 entries) and
an echoed prompt's first token has logprob null (nothing predicts it). Chat: `{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}`.
A token's text is that token decoded alone (special tokens kept), as vLLM reports it.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.logprobs import Logprob


class LogprobTrail:
    """Collects per-token reports; `take()` hands out the object for those collected since the last take."""

    def __init__(self, chat: bool, decode_one: Callable[[int], str]):
        self.chat, self.decode_one, self.offset = chat, decode_one, 0
        self.entries: list[tuple[int, float | None, Logprob | None]] = []  # (token, logprob, alternatives)

    def add(self, delta) -> None:
        """One frontdoor.core.Delta: the echoed prompt's reports first (they come with the first delta,
        beside the prompt's ids; the prompt's first token has no logprob), then the delta's own token."""
        if delta.prompt_logprobs:
            ids = delta.prompt_ids
            self.entries.append((ids[0], None, None))
            self.entries.extend((t, r.logprob, r) for t, r in zip(ids[1:], delta.prompt_logprobs))
        if delta.token is not None and delta.logprob is not None:
            self.entries.append((delta.token, delta.logprob, delta.top))

    def take(self) -> dict:
        entries, self.entries = self.entries, []
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries) -> dict:
        content = []
        for token, lp, top in entries:
            alts = [self._chat_entry(t, v) for t, v in zip(top.top_ids, top.top_logprobs)] if top else []
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
            alts = {self.decode_one(t): v for t, v in zip(top.top_ids, top.top_logprobs)} if top else {}
            tops.append(None if lp is None else alts | {text: lp})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
