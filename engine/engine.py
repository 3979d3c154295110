"""The engine: a model, its KV pool and tokenizer, and the two entry points the roles run.

- `prefill(seqs)`: one packed pass over several fresh prompts of different lengths. Each prompt's
  K/V go to its pages in the local pool, or to the `KVWriter` given for it (a transport into another
  worker's pool). Returns the first token of each.
- `decode_step(seqs)`: one token for every running sequence, reading their pages. Sequences may join
  and leave between steps (continuous batching); the engine keeps no per-batch state.
- `extend(seqs, counts)`: the general pass behind `decode_step`: any number of uncached tokens per
  sequence against its pages (prompt chunks for chunked prefill, mixed with decode tokens).

A caller owns the order of operations: `admit` (validate + reserve pages), then `prefill`, then
`decode_step` until finished, then `release`. Pages are reserved for the whole budget (prompt +
max_tokens) up front, so an admitted request never runs out of pages mid-answer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from engine.attention import KVWriter, PagedAttention, PoolWriter, PrefillAttention, StoppableAttention, TeeAttention
from engine.config import ModelConfig
from engine.cpu_kernels import attention as cpu_attention
from engine.cuda_graphs import DecodeGraphs
from engine.errors import InvalidRequest
from engine.kv_pool import TORCH_DTYPES, KVCache
from engine.page_allocator import PageAllocator
from engine.model import LlamaModel
from engine.prefix_cache import PrefixCache
from engine.sampler import report, sample
from tandem.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence
from engine.tokenizer import Tokenizer
from tandem.kv_layout import KVLayout
from tandem.prefix import engine_salt

TokenOut = tuple[int, float | None]  # (token id, logprob if asked)


class Engine:
    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, cache: KVCache | None, tokens_per_page: int = 16,
                 identity: str = "", prefix_cache: bool = True):
        """`tokens_per_page` is the page size when there is no pool yet (the KV layout peers must match).
        `identity` names the weights (e.g. the manifest's digest): prefix-cache pages of engines with
        different identities never match. `prefix_cache` False: the pool keeps no page after its request."""
        self.model = model
        self.tokens_per_page = cache.layout.tokens_per_page if cache is not None else tokens_per_page
        self.cfg: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        self.identity = identity or f"config:{self.cfg}"
        self.salt = engine_salt(self.identity, self.kv_layout().to_dict())
        self.cache = None
        self.allocator: PageAllocator | None = None
        self.prefix: PrefixCache | None = None
        self.graphs: DecodeGraphs | None = None
        if cache is not None:
            self._use_pool(cache, prefix_cache)
        self.eos_ids = frozenset(self.cfg.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())

    def attach_pool(self, num_pages: int, prefix_cache: bool = True, shared: bool = False) -> None:
        """Give an engine loaded without a KV pool (a prefill worker) a local one of num_pages pages;
        `shared`: in owner-only shared memory, for readers in other processes (the pull handoff)."""
        self._use_pool(KVCache(self.kv_layout(), num_pages, self.device, shared=shared), prefix_cache)

    def use_decode_graphs(self, batch_sizes: tuple[int, ...] | list[int], capture: bool = True) -> None:
        """Run decode steps of up to max(batch_sizes) sequences on CUDA graphs captured at those padded
        sizes (engine/cuda_graphs.py); larger batches, prompt chunks and passes with writers stay eager.
        `capture=False` runs the same padded steps without graphs (any device)."""
        self.graphs = DecodeGraphs(self.model, self.cache, batch_sizes, capture=capture)

    def _use_pool(self, cache: KVCache, prefix_cache: bool) -> None:
        self.cache = cache
        self.allocator = PageAllocator(cache.num_pages, prefix_cache=prefix_cache)
        self.prefix = PrefixCache(self.allocator, self.tokens_per_page, self.salt)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def max_context(self) -> int:
        return self.cfg.max_position

    def kv_layout(self) -> KVLayout:
        dtype = {v: k for k, v in TORCH_DTYPES.items()}[self.model.dtype]
        return KVLayout(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, dtype, self.tokens_per_page)

    # -- requests -----------------------------------------------------------------------------------

    def new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     output_ids: list[int] | tuple[int, ...] = ()) -> Sequence:
        """Validate a request against this model; raise InvalidRequest naming the limit.

        `output_ids` are tokens already generated for this request (a recovery re-prefill continues
        after them: they count against max_tokens and their sampling steps are not repeated).
        """
        if not prompt_ids:
            raise InvalidRequest("prompt is empty; send at least one token")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(f"prompt has {len(prompt_ids)} tokens but the model's context is "
                                 f"{self.max_context}; shorten it to at most {self.max_context - 1}")
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context of "
                f"{self.max_context}; ask for at most {self.max_context - len(prompt_ids)} tokens")
        if len(output_ids) >= params.max_tokens:
            raise InvalidRequest(f"{len(output_ids)} tokens already generated; max_tokens is {params.max_tokens}")
        bad = [t for t in list(prompt_ids) + list(output_ids) if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids must be in [0, {self.cfg.vocab_size}); got {bad[:5]}")
        seq = Sequence(request_id, list(prompt_ids), params.with_seed(), self.eos_ids | set(params.extra_eos),
                       self.max_context, output_ids=list(output_ids))
        seq.attach_text(self.tokenizer)
        return seq

    def can_admit(self, seq: Sequence) -> bool:
        return self.allocator.can_allocate(self.cache.layout.pages_for(seq.budget))

    def admit(self, seq: Sequence) -> None:
        """Reserve pages for the sequence's whole budget. Raises OutOfPages with the pool unchanged."""
        seq.page_table = self.allocator.allocate(self.cache.layout.pages_for(seq.budget))

    def release(self, seq: Sequence) -> None:
        """Return the sequence's pages. Safe to call twice."""
        if seq.page_table:
            self.allocator.free(seq.page_table)
            seq.page_table = []

    def abort(self, seq: Sequence) -> None:
        if not seq.finished:
            seq.finish_reason = FinishReason.ABORT
        self.release(seq)

    # -- passes -------------------------------------------------------------------------------------

    def prefill(self, seqs: list[Sequence], writers: list[KVWriter] | None = None,
                stop: Callable[[], bool] | None = None) -> list[TokenOut]:
        """Run every sequence's tokens (its prompt, plus outputs already streamed when a request is
        re-prefilled after a failure) in one packed pass; append and return each next token.

        Without `writers`, K/V go to each sequence's pages in the local pool (which must be reserved).
        With writers, the caller calls each writer's `finish` (and handles its failure); the K/V and tokens
        are the same bits as without (`_scratch_pass`) up to `one_call_rows` rows. `stop`: checked
        before each layer; once true the pass raises PassStopped and no sequence advances.
        """
        lens = [s.num_tokens for s in seqs]
        tpp = self.tokens_per_page
        tables = [s.page_table[:-(-n // tpp)] for s, n in zip(seqs, lens)] if writers is None else []
        tokens, positions, rope_lens, last, *tabs = self._upload(  # [T], [T], [T], [B], [pages] per sequence
            [t for s in seqs for t in s.all_ids], [p for n in lens for p in range(n)],
            [n for n in lens for _ in range(n)], list(itertools.accumulate(lens, initial=-1))[1:], *tables)
        one_call = sum(lens) <= self.model.one_call_rows
        if writers is None and one_call:  # every layer in one call
            attn = PagedAttention(self.cache, tables, lens, lens)
        elif writers is None:
            attn = PrefillAttention(lens, [PoolWriter(self.cache, tab[pos // tpp] * tpp + pos % tpp)  # [n] slots
                                           for tab, pos in zip(tabs, positions.split(lens))])
        else:
            attn = (self._scratch_pass(lens, writers) if one_call else None) or PrefillAttention(lens, writers)
        rows, spans = self._logit_rows(seqs, [0] * len(seqs), lens, last)
        if stop is not None:
            attn = StoppableAttention(attn, stop)
        logits = self.model.forward(tokens, positions, rope_lens, attn, rows, max_len=max(lens))  # [B + prompt rows, V]
        for s, n in zip(seqs, lens):
            s.num_cached = n
        self._prompt_logprobs(seqs, logits, spans)
        return self._sample(seqs, logits[:len(seqs)])

    def _scratch_pass(self, lens: list[int], writers: list[KVWriter]) -> TeeAttention | None:
        """Prompts whose K/V go straight to writers (no pages of theirs in the local pool), attended over
        pages of a pool made for this pass alone, so the pass runs in one call as a pooled prompt's does:
        a prompt's K/V, first token and log-probs are then the same bits whether or not the worker had
        room for it (the layer loop's PyTorch attention rounds differently). The writers get each layer's
        K/V from those pages once the layer is done. None where the CPU kernel cannot read such a pool."""
        pages = [-(-n // self.tokens_per_page) for n in lens]
        scratch = KVCache(self.kv_layout(), sum(pages), self.device)  # [layers, 2, sum(pages), tpp, Hkv, hd]
        if not cpu_attention.supports(scratch.data):
            return None
        firsts = itertools.accumulate(pages, initial=0)
        tables = [list(range(first, first + n)) for first, n in zip(firsts, pages)]
        return TeeAttention(PagedAttention(scratch, tables, lens, lens), lens, writers, [0] * len(lens))

    def decode_step(self, seqs: list[Sequence]) -> list[TokenOut]:
        """One new token for each sequence; each must have all but its newest token cached."""
        return self.extend(seqs, [1] * len(seqs))

    def extend(self, seqs: list[Sequence], counts: list[int], writers: list[KVWriter] | None = None,
               stop: Callable[[], bool] | None = None) -> list[TokenOut | None]:
        """Process the next `counts[i]` uncached tokens of each sequence against its cached pages.

        This is a decode step (count 1: the newest output token), a prompt chunk (chunked prefill), or
        both in one pass. Sequences left with nothing uncached get their next token; others get None.
        With `writers`, each sequence's new K/V also go to its writer (at their positions). `stop`: as
        for `prefill` (the sequences' pages then hold partial K/V past their cached tokens).
        """
        starts = [s.num_cached for s in seqs]
        ctx = [a + n for a, n in zip(starts, counts)]
        for s, c in zip(seqs, ctx):
            if c > s.num_tokens:
                raise ValueError(f"request {s.request_id}: cannot process past token {s.num_tokens}")
        ids = [t for s, a, c in zip(seqs, starts, ctx) for t in s.all_ids[a:c]]
        if self.graphs is not None and writers is None and stop is None and self.graphs.fits(len(seqs)) \
                and all(n == 1 and c == s.num_tokens for s, n, c in zip(seqs, counts, ctx)):
            logits = self.graphs.run(ids, starts, [s.page_table for s in seqs])  # [B, V]
            for s, c in zip(seqs, ctx):
                s.num_cached = c
            return self._sample(seqs, logits)
        tokens, positions, rope_lens, last = self._upload(  # [T], [T], [T] sequence length per token, [B]
            ids, [p for a, c in zip(starts, ctx) for p in range(a, c)],
            [c for c, n in zip(ctx, counts) for _ in range(n)], list(itertools.accumulate(counts, initial=-1))[1:])
        attn = PagedAttention(self.cache, [s.page_table for s in seqs], counts, ctx)
        if writers is not None:
            attn = TeeAttention(attn, counts, writers, starts)
        if stop is not None:
            attn = StoppableAttention(attn, stop)
        rows, spans = self._logit_rows(seqs, starts, ctx, last)
        logits = self.model.forward(tokens, positions, rope_lens, attn, rows, max_len=max(ctx))  # [B + prompt rows, V]
        self._prompt_logprobs(seqs, logits, spans)
        logits = logits[:len(seqs)]  # [B, V]
        ready = []
        for i, (s, c) in enumerate(zip(seqs, ctx)):
            s.num_cached = c
            if c == s.num_tokens:
                ready.append(i)
        outs: list[TokenOut | None] = [None] * len(seqs)
        if ready:
            sampled = self._sample([seqs[i] for i in ready], logits[ready] if len(ready) < len(seqs) else logits)
            for i, out in zip(ready, sampled):
                outs[i] = out
        return outs

    def _upload(self, *parts: list[int]) -> list[torch.Tensor]:
        """A pass's host-side metadata in one copy to the device: an int64 view per list, in order."""
        flat = torch.tensor([x for part in parts for x in part], dtype=torch.int64).to(self.device)
        return list(flat.split([len(part) for part in parts]))

    def _logit_rows(self, seqs: list[Sequence], starts: list[int], ends: list[int], last: torch.Tensor
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
        return torch.tensor(rows + extra, device=self.device), spans  # [B + extra]

    def _prompt_logprobs(self, seqs: list[Sequence], logits: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
        """logits: [B + extra, V] (rows from _logit_rows) -> each span's reports appended to its sequence."""
        row = len(seqs)
        for i, first, n in spans:
            s = seqs[i]
            lp = torch.log_softmax(logits[row:row + n].float(), dim=-1)  # [n, V]
            nxt = torch.tensor(s.prompt_ids[first + 1:first + 1 + n], device=lp.device)  # [n]
            del s.prompt_logprobs[first:]  # a prompt computed again (a given-up pass redone) replaces its reports
            s.prompt_logprobs.extend(report(lp, nxt, [s.params.top_logprobs] * n))
            row += n

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[TokenOut]:
        """logits: [B, V] -> each sequence's next token, appended; the logprob when asked (the report
        with alternatives stays on the sequence: Sequence.last_logprob)."""
        history = [s.all_ids if s.params.penalized else [] for s in seqs]
        tokens, reports = sample(logits, [s.params for s in seqs], [len(s.output_ids) for s in seqs],
                                 [s.banned_ids() for s in seqs], history)
        outs = []
        for s, t, r in zip(seqs, tokens, reports):
            s.append(t, r)
            outs.append((t, r.logprob if r is not None else None))
        return outs
