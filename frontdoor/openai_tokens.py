"""What an OpenAI reply shows of its tokens beside the text, built token by token from the
orchestrator's deltas: logprobs, vLLM's prompt_logprobs, and vLLM's token ids.

- Completions' `logprobs`: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each
  top_logprobs entry maps token text to logprob (the chosen token always included, so up to logprobs+1
  entries) and an echoed prompt's first token has logprob null (nothing predicts it). Chat's:
  `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": null}`.
- vLLM's `prompt_logprobs`: `[null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]`, one
  object per prompt token, its own entry first and then its alternatives.
- vLLM's `return_token_ids`: `prompt_token_ids` and `token_ids` (the answer's, every generated token;
  streamed, each chunk's own): on each choice of a completion; a chat reply's `prompt_token_ids` at its
  top (streamed: on each choice's first chunk).

A token's text is that token decoded alone (special tokens kept), as vLLM reports it, or, with vLLM's
`return_tokens_as_token_ids`, "token_id:<id>" (completions' text_offset still counts the text itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.logprobs import Logprob


@dataclass(frozen=True)
class Shown:
    """What a reply shows of its tokens: `top` alternatives per token (the engine may report more, for
    `prompt_logprobs`), vLLM's `prompt_logprobs` (k alternatives; None: not asked), whether the echoed
    prompt's tokens are among the answer's logprobs (completions' echo with logprobs), vLLM's
    `return_token_ids` and `return_tokens_as_token_ids`."""

    top: int = 0
    prompt_logprobs: int | None = None
    echo: bool = False
    token_ids: bool = False
    as_ids: bool = False

    def any(self, logprobs: bool) -> bool:
        """Whether a request with (or without) `logprobs` needs a trail."""
        return logprobs or self.prompt_logprobs is not None or self.token_ids


class TokenTrail:
    """One answer's token reports, as its deltas come: `take()` hands out the logprobs object for those
    collected since the last take (None if the request did not ask for logprobs), `take_ids()` the
    answer's token ids since the last; `prompt` is vLLM's prompt_logprobs and `prompt_ids` the prompt's
    ids once the first delta came."""

    def __init__(self, chat: bool, decode_one: Callable[[int], str], logprobs: bool, shown: Shown):
        self.chat, self.decode_one, self.logprobs, self.shown, self.offset = chat, decode_one, logprobs, shown, 0
        self.entries: list[tuple[int, float | None, Logprob | None]] = []  # (token, logprob, alternatives)
        self.ids: list[int] = []  # the answer's tokens since the last take_ids
        self.prompt: list[dict | None] | None = None
        self.prompt_ids: tuple[int, ...] = ()

    def add(self, delta) -> None:
        """One frontdoor.core.Delta: the prompt's reports first (they come with the first delta, beside the
        prompt's ids; the prompt's first token has no logprob), then the delta's own token."""
        if delta.prompt_ids:
            self.prompt_ids = delta.prompt_ids
        if delta.prompt_logprobs:
            ids = delta.prompt_ids
            if self.shown.echo:
                self.entries.append((ids[0], None, None))
                self.entries.extend((t, r.logprob, r) for t, r in zip(ids[1:], delta.prompt_logprobs))
            if self.shown.prompt_logprobs is not None:
                self.prompt = [None, *(self._scored(t, r) for t, r in zip(ids[1:], delta.prompt_logprobs))]
        if delta.token is not None:
            self.ids.append(delta.token)
            if delta.logprob is not None:
                self.entries.append((delta.token, delta.logprob, delta.top))

    def take(self) -> dict | None:
        entries, self.entries = self.entries, []
        if not self.logprobs:
            return None
        return self._chat(entries) if self.chat else self._completion(entries)

    def take_ids(self) -> list[int]:
        ids, self.ids = self.ids, []
        return ids

    def _name(self, token: int) -> str:
        return f"token_id:{token}" if self.shown.as_ids else self.decode_one(token)

    def _scored(self, token: int, r: Logprob) -> dict:
        """vLLM's report of one prompt token: {id: {"logprob", "rank", "decoded_token"}} for the token
        itself, then its top alternatives (rank 1 first); the token is not repeated among them."""
        out = {str(token): {"logprob": r.logprob, "rank": r.rank, "decoded_token": self._name(token)}}
        k = self.shown.prompt_logprobs
        for i, (t, v) in enumerate(zip(r.top_ids[:k], r.top_logprobs[:k])):
            out.setdefault(str(t), {"logprob": v, "rank": i + 1, "decoded_token": self._name(t)})
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
        text = self._name(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    def _completion(self, entries) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for token, lp, top in entries:
            name = self._name(token)
            tokens.append(name)
            lps.append(lp)
            offsets.append(self.offset)
            self.offset += len(self.decode_one(token)) if self.shown.as_ids else len(name)
            alts = {self._name(t): v for t, v in self._alternatives(top)}
            tops.append(None if lp is None else alts | {name: lp})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def watching(*calls: Callable | None) -> Callable | None:
    """One delta watcher calling each of `calls` that is not None, in order (None when none is)."""
    kept = [c for c in calls if c is not None]
    if not kept:
        return None

    def watch(delta) -> None:
        for call in kept:
            call(delta)
    return watch


def trail_of(req, chat: bool, shown: Shown, tokenizer) -> TokenTrail | None:
    """The token reports of answer `req` (a GenerationRequest), when its request asked for any."""
    if not shown.any(req.logprobs):
        return None
    return TokenTrail(chat, lambda t: tokenizer.decode([t], skip_special_tokens=False), req.logprobs, shown)


def whole_extras(body: dict, trails: list[TokenTrail | None], shown: Shown, chat: bool) -> dict:
    """A whole reply's vLLM extras from each choice's trail: prompt_logprobs and, with return_token_ids,
    prompt_token_ids and token_ids; on each choice of a completion, a chat reply's prompt ones once at
    its top (its answers share one prompt)."""
    for choice, trail in zip(body["choices"], trails):
        prompt = {}
        if shown.prompt_logprobs is not None:
            prompt["prompt_logprobs"] = trail.prompt
        if shown.token_ids:
            prompt["prompt_token_ids"] = list(trail.prompt_ids)
            choice["token_ids"] = trail.take_ids()
        (body if chat else choice).update(prompt)
    return body


def chunk_extras(event: dict, trail: TokenTrail, shown: Shown, chat: bool, first: bool) -> dict:
    """A streamed chunk's logprobs and, with return_token_ids, token ids since the choice's last chunk
    (and on its first chunk the prompt's: in the choice of a completion, at the top of a chat chunk)."""
    choice = event["choices"][0]
    choice["logprobs"] = trail.take()
    if shown.token_ids:
        choice["token_ids"] = trail.take_ids()
        if first:
            (event if chat else choice)["prompt_token_ids"] = list(trail.prompt_ids)
    return event
