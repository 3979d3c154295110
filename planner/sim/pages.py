"""A KV page pool's accounting: pages are reserved for a request's whole budget and freed at its end."""

from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int, tokens_per_page: int, trace: bool = False):
        """`trace`: keep (time, pages reserved) after every change, for tests and plots."""
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least 1 page, got {num_pages}")
        self.num_pages = num_pages
        self.tokens_per_page = tokens_per_page
        self.used = 0
        self.peak = 0
        self.trace: list[tuple[float, int]] | None = [] if trace else None

    @property
    def pages_free(self) -> int:
        return self.num_pages - self.used

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_page)

    def can_reserve(self, tokens: int) -> bool:
        return self.used + self.pages_for(tokens) <= self.num_pages

    def reserve(self, tokens: int, now: float) -> int:
        """Reserve pages for `tokens`; returns the page count. A scheduler checks can_reserve first."""
        n = self.pages_for(tokens)
        if self.used + n > self.num_pages:
            raise RuntimeError(f"simulator bug: reserving {n} pages with {self.pages_free} free")
        self.used += n
        self.peak = max(self.peak, self.used)
        if self.trace is not None:
            self.trace.append((now, self.used))
        return n

    def free(self, pages: int, now: float) -> None:
        if pages > self.used:
            raise RuntimeError(f"simulator bug: freeing {pages} pages with {self.used} reserved")
        self.used -= pages
        if self.trace is not None:
            self.trace.append((now, self.used))
