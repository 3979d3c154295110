"""Prompts from a file for `tandem bench --dataset`: your own traffic, or the ShareGPT file that vLLM's
and SGLang's serving benchmarks replay, so a run here compares with theirs.

Two formats, told apart by the first character of the file:

- ShareGPT (`[` ...): a JSON list of `{"conversations": [{"from": "human", "value": prompt},
  {"from": "gpt", "value": reply}, ...]}`. As vLLM's benchmark reads it: the first turn is the prompt,
  the second the reply, whose length in tokens is the answer's length; a conversation of fewer than
  two turns is left out, and so is one whose prompt or reply is under 4 tokens, whose prompt is over
  1024, or whose prompt and reply together are over 2048 tokens.
- JSON Lines (`{` ...): one object per line, `{"prompt": text}` with an optional `"max_tokens"` (the
  answer's length; `--output-len` where it is absent). Nothing is left out.

`sample` takes `count` entries in an order shuffled by the seed, tokenizing only as many as it needs;
`--output-len`, where given, sets every answer's length. A file with fewer usable entries than asked
is sent round again in the same order (each repeat a prefix-cache hit, which the note says).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

MIN_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048  # vLLM's ShareGPT filter


@dataclass(frozen=True)
class Entry:
    prompt: str
    reply: str | None = None  # ShareGPT's: its token count is the answer's length
    max_tokens: int | None = None  # JSON Lines': the answer's length


@dataclass(frozen=True)
class Sample:
    prompt: str
    prompt_tokens: int
    output_tokens: int  # the answer's length: sent as max_tokens and min_tokens


def read(path: str) -> tuple[list[Entry], bool]:
    """(the file's entries, whether it is ShareGPT); a malformed file is a ValueError naming where."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head = text.lstrip()[:1]
    if head == "[":
        return _sharegpt(path, text), True
    if head == "{":
        return [_line(path, n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()], False
    raise ValueError(f"{path}: neither a ShareGPT JSON list ('[') nor JSON Lines of {{\"prompt\": ...}} ('{{')")


def sample(path: str, tokenizer, count: int, seed: int, output_len: int | None,
           default_output_len: int) -> tuple[list[Sample], str]:
    """`count` samples of the file and a note for the user ("" when there is nothing to say)."""
    entries, sharegpt = read(path)
    random.Random(seed).shuffle(entries)
    picked: list[Sample] = []
    for e in entries:
        if len(picked) == count:
            break
        n_in = len(tokenizer.encode(e.prompt))
        n_out = output_len or (len(tokenizer.encode(e.reply)) if e.reply is not None else
                               e.max_tokens or default_output_len)
        if not sharegpt or _kept(n_in, n_out, fixed=output_len is not None):
            picked.append(Sample(e.prompt, n_in, n_out))
    if not picked:
        raise ValueError(f"{path}: none of its {len(entries)} entries is usable (ShareGPT: prompt and reply of "
                         f">= {MIN_TOKENS} tokens, prompt <= {MAX_PROMPT_TOKENS}, both <= {MAX_TOTAL_TOKENS})")
    if len(picked) == count:
        return picked, ""
    note = (f"{path} has {len(picked)} usable entries for {count} requests: they are sent round again "
            f"(repeated prompts hit the prefix cache)")
    return [picked[i % len(picked)] for i in range(count)], note


def _kept(n_in: int, n_out: int, fixed: bool) -> bool:
    """vLLM's ShareGPT filter (its reply-length floor waived when the answer's length is fixed)."""
    short = n_in < MIN_TOKENS or (not fixed and n_out < MIN_TOKENS)
    return not short and n_in <= MAX_PROMPT_TOKENS and n_in + n_out <= MAX_TOTAL_TOKENS


def _sharegpt(path: str, text: str) -> list[Entry]:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    out = []
    for i, item in enumerate(doc):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            raise ValueError(f"{path}: entry {i} has no 'conversations' list (ShareGPT: "
                             f"{{\"conversations\": [{{\"from\", \"value\"}}, ...]}})")
        if len(turns) < 2:
            continue
        values = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
        if not all(isinstance(v, str) for v in values):
            raise ValueError(f"{path}: entry {i}: its first two turns need a string 'value'")
        out.append(Entry(values[0], reply=values[1]))
    return out


def _line(path: str, n: int, line: str) -> Entry:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    prompt, max_tokens = (obj.get("prompt"), obj.get("max_tokens")) if isinstance(obj, dict) else (None, None)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{path}:{n}: each line is {{\"prompt\": a non-empty string, \"max_tokens\": optional}}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError(f"{path}:{n}: max_tokens must be an integer >= 1, got {max_tokens!r:.40}")
    return Entry(prompt, max_tokens=max_tokens)
