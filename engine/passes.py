"""One pass of the model over a packed batch of sequences' rows (engine/engine.py decides which rows and
where their K/V go), and how a pass longer than one call takes is cut into rounds.

A pass computes `counts[i]` tokens of sequence i from position `starts[i]`, the sequences' rows one
after another in one `[T, ...]` batch; it returns the logits of each sequence's last row and records
the prompt log-probs its sequences asked for. It does not advance the sequences (`num_cached`, tokens):
that is the caller's, once every round of the pass is done.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from engine.attention import Attention, StoppableAttention
from engine.lora import rows_of
from engine.model import LlamaModel
from engine.sampler import report
from engine.sequence import Sequence


def rounds(counts: list[int], limit: int, split: bool = True) -> list[list[tuple[int, int, int]]]:
    """A pass of `counts[i]` rows of sequence i as rounds of at most `limit` rows, in order: each round a
    list of (sequence, offset into its rows, rows). With `split` a sequence's rows may go on in the next
    round; without, sequences stay whole and one longer than `limit` is a round of its own."""
    out, part, room = [], [], limit
    for i, n in enumerate(counts):
        offset = 0
        while offset < n:
            if part and (room <= 0 or (not split and n > room)):
                out.append(part)
                part, room = [], limit
            take = min(n - offset, room) if split else n
            part.append((i, offset, take))
            offset, room = offset + take, room - take
    return out + [part] if part else out


def forward(model: LlamaModel, seqs: list[Sequence], starts: list[int], counts: list[int], attn: Attention,
            stop: Callable[[], bool] | None) -> torch.Tensor:
    """`counts[i]` tokens of sequence i from position `starts[i]` through the model, attending through
    `attn` (checked against `stop` before each layer), each sequence's rows with its LoRA adapter's
    updates (Sequence.adapter); prompt log-probs recorded -> logits [B, V] at each sequence's last row."""
    ends = [a + n for a, n in zip(starts, counts)]
    tokens, positions, rope_lens, last = upload(  # [T], [T], [T] sequence length per token, [B]
        model.device, [t for s, a, c in zip(seqs, starts, ends) for t in s.all_ids[a:c]],
        [p for a, c in zip(starts, ends) for p in range(a, c)],
        [c for c, n in zip(ends, counts) for _ in range(n)], list(itertools.accumulate(counts, initial=-1))[1:])
    if stop is not None:
        attn = StoppableAttention(attn, stop)
    rows, spans = _logit_rows(seqs, starts, ends, last)
    held = {s.params.lora: s.adapter for s in seqs if s.adapter is not None}  # not model.loras: it may change
    lora = rows_of(held, [s.params.lora for s in seqs], counts, model.device, model.dtype)
    logits = model.forward(tokens, positions, rope_lens, attn, rows, max_len=max(ends),
                           lora=lora)  # [B + prompt rows, V]
    _prompt_logprobs(seqs, logits, spans)
    return logits[:len(seqs)]  # [B, V]


def upload(device: torch.device, *parts: list[int]) -> list[torch.Tensor]:
    """A pass's host-side metadata in one copy to the device: an int64 view per list, in order."""
    flat = torch.tensor([x for part in parts for x in part], dtype=torch.int64).to(device)
    return list(flat.split([len(part) for part in parts]))


def _logit_rows(seqs: list[Sequence], starts: list[int], ends: list[int], last: torch.Tensor
                ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Rows of a packed pass (sequence i computes positions starts[i]..ends[i]-1) to take logits at:
    each sequence's last row ([B], in order: `last`, already on the device, is returned as it is when
    no sequence asks for more), then, for sequences asking for prompt logprobs, every computed prompt
    position that predicts a prompt token. spans: (sequence, first position, rows)."""
    rows, extra, spans, offset = [], [], [], 0
    for i, (s, a, c) in enumerate(zip(seqs, starts, ends)):
        rows.append(offset + c - a - 1)
        upto = min(c, len(s.prompt_ids) - 1)  # position p predicts token p + 1
        if s.params.prompt_logprobs and not s.output_ids and upto > a:
            extra.extend(range(offset, offset + upto - a))
            spans.append((i, a, upto - a))
        offset += c - a
    if not spans:
        return last, spans  # [B]
    return torch.tensor(rows + extra, device=last.device), spans  # [B + extra]


def _prompt_logprobs(seqs: list[Sequence], logits: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
    """logits: [B + extra, V] (rows from _logit_rows) -> each span's reports appended to its sequence."""
    row = len(seqs)
    for i, first, n in spans:
        s = seqs[i]
        lp = torch.log_softmax(logits[row:row + n].float(), dim=-1)  # [n, V]
        nxt = torch.tensor(s.prompt_ids[first + 1:first + 1 + n], device=lp.device)  # [n]
        del s.prompt_logprobs[first:]  # a prompt computed again (a given-up pass redone) replaces its reports
        s.prompt_logprobs.extend(report(lp, nxt, [s.params.top_logprobs] * n, ranks=True))
        row += n
