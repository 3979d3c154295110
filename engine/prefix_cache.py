"""A worker's requests and its pool's prefix cache: reserve pages reusing a cached prefix, name pages once computed.

The page allocator (engine/kv_pool.py) keeps named pages after their request ends; this is the policy
on top of it that every role shares (decode, co-located and prefill workers):

- `reserve(seq, pages)`: the request's page table starts with the longest run of cached pages that
  hold its tokens, and `seq.num_cached` says how many leading tokens need no computing. The last token
  is never taken from the cache: its logits give the next token, so at least it is computed.
- `commit(seq)`: every full page whose K/V are now in the pool (positions below `seq.num_cached`) is
  named by its chained hash (tandem/prefix.py). A page is named only after its K/V are complete (a
  page a remote writer fills is committed by the caller once the pages arrived, never before), and a
  page a request still writes into is partial, so never named: a named page is never written again.

A request writes only positions at or after its `num_cached`, so it never writes a shared cached page:
those sit wholly before its first uncached token. Hashes run over `all_ids` (the prompt, then the
outputs), so a conversation's next turn can reuse the pages of the previous answer too.

Not thread-safe: the worker calls it under the lock that guards its allocator.
"""

from __future__ import annotations

from engine.page_allocator import PageAllocator
from engine.sequence import Sequence
from tandem.prefix import extend_page_hashes, tenant_salt


class PrefixCache:
    def __init__(self, allocator: PageAllocator, tokens_per_page: int, salt: bytes):
        """`salt`: the engine's identity (tandem.prefix.engine_salt); pages of other weights never match."""
        self.allocator, self.tokens_per_page, self.salt = allocator, tokens_per_page, salt

    @property
    def enabled(self) -> bool:
        return self.allocator.enabled

    def reserve(self, seq: Sequence, pages: int) -> int:
        """Give `seq` a table of `pages` pages, the leading ones taken from the cache; returns the tokens
        taken (a multiple of tokens_per_page). Raises OutOfPages with the pool unchanged."""
        usable = self._usable(seq)
        hashes = self._hashes(seq, min(usable, pages)) if self.enabled else []
        table, matched = self.allocator.allocate_prefixed(hashes, pages)
        seq.page_table, seq.committed = table, matched
        seq.num_cached = matched * self.tokens_per_page
        return seq.num_cached

    def peek(self, seq: Sequence) -> int:
        """The tokens `reserve` would take from the cache now; changes nothing."""
        if not self.enabled:
            return 0
        usable = self._usable(seq)
        return self.allocator.peek(self._hashes(seq, usable)) * self.tokens_per_page

    def commit(self, seq: Sequence) -> int:
        """Name the full pages of `seq` whose K/V are computed and not yet named; returns how many."""
        full = min(seq.num_cached // self.tokens_per_page, len(seq.page_table))
        if not self.enabled or full <= seq.committed:
            return 0
        hashes = self._hashes(seq, full)
        for i in range(seq.committed, full):
            # False when another page already holds this content: this one simply stays unnamed
            self.allocator.commit(seq.page_table[i], hashes[i])
        n, seq.committed = full - seq.committed, full
        return n

    def _usable(self, seq: Sequence) -> int:
        """Full pages before the last token that a cached copy may stand for; none when the request
        wants its prompt's logprobs (those need every prompt position computed)."""
        return 0 if seq.params.prompt_logprobs else (seq.num_tokens - 1) // self.tokens_per_page

    def _hashes(self, seq: Sequence, pages: int) -> list[bytes]:
        """The hashes of the first `pages` full pages of seq.all_ids (computed once, extended as it grows),
        chained from the engine's salt with the request's cache_salt and LoRA adapter mixed in."""
        if len(seq.page_hashes) < pages:
            extend_page_hashes(seq.page_hashes, seq.all_ids, self.tokens_per_page,
                               tenant_salt(self.salt, seq.params.cache_salt, seq.params.lora),
                               limit=pages)
        return seq.page_hashes[:pages]
