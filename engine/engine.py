"""The engine: a model, its KV pool and tokenizer, and the two entry points the roles run.

- `prefill(seqs)`: one packed pass over several fresh prompts of different lengths. Each prompt's
  K/V go to its pages in the local pool, or to the `KVWriter` given for it (a transport into another
  worker's pool). Returns the first token of each.
- `decode_step(seqs)`: one token for every running sequence, reading their pages. Sequences may join
  and leave between steps (continuous batching); the engine keeps no per-batch state.
- `extend(seqs, counts)`: the general pass behind `decode_step`: any number of uncached tokens per
  sequence against its pages (prompt chunks for chunked prefill, mixed with decode tokens).

On a CPU with Tandem's kernels a pass of up to `one_call_rows` rows runs every layer in one call, and a
longer one in rounds of such calls (engine/passes.py), so a row's bits never depend on the pass it is in.

A caller owns the order of operations: `admit` (validate + reserve pages), then `prefill`, then
`decode_step` until finished, then `release`. Pages are reserved for the whole budget (prompt +
max_tokens) up front, so an admitted request never runs out of pages mid-answer.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch

from engine.attention import KVWriter, PagedAttention, PoolWriter, PrefillAttention, TeeAttention
from engine.config import ModelConfig
from engine.cpu_kernels import attention as cpu_attention
from engine.cuda_graphs import DecodeGraphs
from engine.errors import InvalidRequest
from engine.guided import guides_for, masks
from engine.kv_pool import TORCH_DTYPES, KVCache
from engine.page_allocator import PageAllocator
from engine.model import LlamaModel
from engine.passes import forward, rounds
from engine.prefix_cache import PrefixCache
from engine.sampler import sample
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
        self.eos_ids = tokenizer.end_ids(self.cfg.eos_token_ids)
        self.guides = guides_for(tokenizer.file, self.cfg.vocab_size, tuple(sorted(self.eos_ids)))
        self.guides.warm()

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
        adapter = self.model.loras.get(params.lora) if params.lora else None
        if params.lora and adapter is None:
            raise InvalidRequest(f"unknown LoRA adapter {params.lora!r}; this engine has "
                                 f"{sorted(self.model.loras) or 'none'}")
        if len(output_ids) >= params.max_tokens:
            raise InvalidRequest(f"{len(output_ids)} tokens already generated; max_tokens is {params.max_tokens}")
        bad = [t for t in [*prompt_ids, *output_ids, *(t for w in params.bad_words for t in w)]
               if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids must be in [0, {self.cfg.vocab_size}); got {bad[:5]}")
        seq = Sequence(request_id, list(prompt_ids), params.with_seed(), self.eos_ids | set(params.extra_eos),
                       self.max_context, output_ids=list(output_ids))
        seq.attach_text(self.tokenizer)
        seq.attach_guide(self.guides)
        seq.adapter = adapter
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
        re-prefilled after a failure) from position 0; append and return each next token.

        Without `writers`, K/V go to each sequence's pages in the local pool (which must be reserved).
        With writers, the caller calls each writer's `finish` (and handles its failure). On a CPU where
        the one-call pass applies, a prompt's K/V, token and log-probs are the same bits with writers or
        without, whatever prompts share the pass (`_pass`, `_direct`). `stop`: checked before each layer;
        once true the pass raises PassStopped and no sequence advances.
        """
        lens = [s.num_tokens for s in seqs]
        limit = self.model.one_call_rows
        in_calls = limit and (sum(lens) <= limit or self.model.in_rounds)  # every row through one-call passes
        if in_calls and writers is None and cpu_attention.supports(self.cache.data):
            logits = self._pass(seqs, [0] * len(seqs), lens, None, stop)
        elif in_calls and writers is not None and self._scratch_fits:
            logits = self._direct(seqs, lens, writers, stop)
        else:  # the layer loop, PyTorch's causal attention per sequence
            tpp = self.tokens_per_page
            writers = writers or [PoolWriter(self.cache, slots) for slots in torch.tensor(  # [n] each: positions 0..n-1
                [s.page_table[p // tpp] * tpp + p % tpp for s, n in zip(seqs, lens) for p in range(n)],
                device=self.device).split(lens)]  # one upload
            logits = forward(self.model, seqs, [0] * len(seqs), lens, PrefillAttention(lens, writers), stop)
        for s, n in zip(seqs, lens):
            s.num_cached = n
        return self._sample(seqs, logits)

    @functools.cached_property
    def _scratch_fits(self) -> bool:
        """Whether the CPU kernel reads a pool of this engine's layout (one page made once to ask)."""
        return cpu_attention.supports(KVCache(self.kv_layout(), 1, self.device).data)

    def _direct(self, seqs: list[Sequence], lens: list[int], writers: list[KVWriter],
                stop: Callable[[], bool] | None) -> torch.Tensor:
        """Prompts whose K/V go straight to writers (no pages of theirs in the local pool), in rounds of whole
        prompts of at most `one_call_rows` rows: each round attends over pages of a pool made for it alone,
        so it runs in one call as a pooled pass does (the writers get each layer's K/V from those pages once
        the layer is done) -> logits [B, V] at each last row. A longer prompt, a round of its own, runs the
        layer loop (pages for all of it are what this worker had no room for)."""
        last: list[torch.Tensor] = [None] * len(seqs)  # [V] each
        limit = self.model.one_call_rows
        for part in rounds(lens, limit, split=False):
            idx = [i for i, _, _ in part]
            ns, outs = [lens[i] for i in idx], [writers[i] for i in idx]
            pages = [-(-n // self.tokens_per_page) for n in ns]
            if sum(ns) > limit:
                attn = PrefillAttention(ns, outs)
            else:
                scratch = KVCache(self.kv_layout(), sum(pages), self.device)  # [layers, 2, sum(pages), tpp, Hkv, hd]
                tables = [list(range(first, first + n)) for first, n in zip(itertools.accumulate(pages, initial=0), pages)]
                attn = TeeAttention(PagedAttention(scratch, tables, ns, ns), ns, outs, [0] * len(ns))
            for i, row in zip(idx, forward(self.model, [seqs[i] for i in idx], [0] * len(ns), ns, attn, stop)):
                last[i] = row
        return torch.stack(last)

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
        if self.graphs is not None and writers is None and stop is None and self.graphs.fits(len(seqs)) \
                and all(n == 1 and c == s.num_tokens and not s.params.lora for s, n, c in zip(seqs, counts, ctx)):
            logits = self.graphs.run([s.all_ids[a] for s, a in zip(seqs, starts)], starts,
                                     [s.page_table for s in seqs])  # [B, V]
            for s, c in zip(seqs, ctx):
                s.num_cached = c
            return self._sample(seqs, logits)
        logits = self._pass(seqs, starts, counts, writers, stop)  # [B, V]
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

    def _pass(self, seqs: list[Sequence], starts: list[int], counts: list[int], writers: list[KVWriter] | None,
              stop: Callable[[], bool] | None) -> torch.Tensor:
        """Compute `counts[i]` tokens of sequence i from position `starts[i]` against its pages (writers, if
        any, also get the new K/V; prompt log-probs are recorded) -> logits [B, V] at each sequence's last
        row. Where the CPU kernel reads the pool and the model runs long passes `in_rounds` (fp32), a pass
        of more than `one_call_rows` rows runs as rounds of at most that many, each in one call, a
        sequence's rows continuing in the next round: every row's bits are then the ones it has in any
        other pass (the layer loop's PyTorch attention rounds differently; engine/cpu_kernels/layers.py
        has the times). Sequences do not advance here: the caller sets `num_cached` once every round is done."""
        limit = self.model.one_call_rows
        if sum(counts) <= limit or not self.model.in_rounds or not cpu_attention.supports(self.cache.data):
            return forward(self.model, seqs, starts, counts, self._paged(seqs, starts, counts, writers), stop)
        last: list[torch.Tensor] = [None] * len(seqs)  # [V] each; a sequence's from its last round
        for part in rounds(counts, limit):
            idx = [i for i, _, _ in part]
            sub, ns = [seqs[i] for i in idx], [n for _, _, n in part]
            firsts = [starts[i] + offset for i, offset, _ in part]
            attn = self._paged(sub, firsts, ns, None if writers is None else [writers[i] for i in idx])
            for i, row in zip(idx, forward(self.model, sub, firsts, ns, attn, stop)):
                last[i] = row
        return torch.stack(last)

    def _paged(self, seqs: list[Sequence], starts: list[int], counts: list[int], writers: list[KVWriter] | None):
        """Attention over the sequences' pages for `counts[i]` tokens from `starts[i]`; writers get the new K/V."""
        attn = PagedAttention(self.cache, [s.page_table for s in seqs], counts, [a + n for a, n in zip(starts, counts)])
        return attn if writers is None else TeeAttention(attn, counts, writers, starts)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[TokenOut]:
        """logits: [B, V] -> each sequence's next token, appended; the logprob when asked (the report
        with alternatives stays on the sequence: Sequence.last_logprob)."""
        history = [s.all_ids if s.params.penalized else [] for s in seqs]
        rows = [i for i, s in enumerate(seqs) if s.guide is not None]
        guided = (rows, torch.from_numpy(masks([seqs[i].guide for i in rows], self.cfg.vocab_size))) if rows else None
        tokens, reports = sample(logits, [s.params for s in seqs], [len(s.output_ids) for s in seqs],
                                 [s.banned_ids() for s in seqs], history, guided)
        outs = []
        for s, t, r in zip(seqs, tokens, reports):
            s.append(t, r)
            outs.append((t, r.logprob if r is not None else None))
        return outs
