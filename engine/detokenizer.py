"""Incremental detokenization with stop strings, shared by the engine and the orchestrator.

Text is emitted only when it is final: never half a UTF-8 character, never the first characters of
what may turn out to be a stop string. When a stop string appears, the text is cut where it starts
(the stop string itself is not part of the answer, as in the OpenAI API), or where it ends when the
request keeps it (vLLM's include_stop_str_in_output). Special tokens are left out of the text unless
the request keeps them (vLLM's skip_special_tokens=false).
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TextStream:
    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 keep_stop: bool = False):
        self._tok = tokenizer
        self._stop = stop
        self._skip, self._keep_stop = skip_special_tokens, keep_stop
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] is context decoded again so word boundaries stay right
        self._read = 0
        self.text = ""
        self._emitted = 0
        self._searched = 0  # text before this offset holds no stop string
        self.stopped = False
        self.stop_string: str | None = None  # the stop string the text met

    def add(self, token_id: int) -> str:
        """Feed one output token; return the text that became final (may be empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        self._find_stop()
        return self._take(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever text was held back."""
        return self._take(final=True)

    def stop_reason(self, token: int | None, stop_token_ids: tuple[int, ...]) -> str | int | None:
        """vLLM's stop_reason of an answer that ended with finish reason "stop": the stop string the text
        met, or the stop token (one of `stop_token_ids`) it ended on; None for the model's end token."""
        if self.stop_string is not None:
            return self.stop_string
        return token if token in stop_token_ids else None

    def _find_stop(self) -> None:
        if not self._stop:
            return
        longest = max(len(s) for s in self._stop)
        start = max(0, self._searched - longest + 1)
        hits = [(i, len(s), s) for i, s in ((self.text.find(s, start), s) for s in self._stop) if i >= 0]
        if hits:
            at, length, self.stop_string = min(hits)  # the first (of two starting there, the shorter: whole first)
            self.text = self.text[:at + length if self._keep_stop else at]
            self.stopped = True
        self._searched = len(self.text)

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._pending_stop_prefix()
        out = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return out

    def _pending_stop_prefix(self) -> int:
        """Length of the longest tail of the text that is the beginning of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
