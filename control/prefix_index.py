"""The router's view of which prefix-cache pages each worker holds, to send a prompt where its prefix is.

Each worker's KV pool reports the page hashes (tandem/prefix.py) it started and stopped holding since
its last report (`PageAllocator.drain_events`), or its whole set after an overflow or on (re)connect
(`PageAllocator.snapshot`). The index applies those reports in the order the worker made them and
answers one question: how many leading pages of a prompt would this worker find cached?

The index is advisory. A hash it lacks costs a cache-blind routing choice; a hash it wrongly holds
costs the worker a cache miss (the worker's own `match` is what decides). Never a wrong answer. That
is what makes the memory cap safe: each worker's set holds at most `max_hashes_per_worker` hashes,
and past that the ones reported longest ago are forgotten first. A pool never holds more hashes than
it has pages, so a cap at least the largest pool's page count only ever trims a misbehaving worker.

`PrefixView` feeds an index from the workers' stats pushes (each carries that watcher's own changes,
or a whole snapshot: engine/workers/cache_feed.py) and answers, per request, how many prompt tokens a
worker holds, hashing the prompt once per distinct engine salt the workers report.

Pure Python; no other orchestrator module is imported. Not thread-safe: the event loop serializes calls.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from itertools import islice

from tandem.prefix import HASH_BYTES, HEX_CHARS, hashes_from_hex, page_hashes, tenant_salt

log = logging.getLogger("tandem.prefix")

DEFAULT_MAX_HASHES = 1 << 17  # ~20 MiB per worker; more pages than a large GPU pool holds


class PrefixIndex:
    """Per worker, the set of page hashes it reported holding (insertion-ordered, oldest first)."""

    def __init__(self, max_hashes_per_worker: int = DEFAULT_MAX_HASHES):
        if not isinstance(max_hashes_per_worker, int) or max_hashes_per_worker < 1:
            raise ValueError(f"max_hashes_per_worker must be an integer >= 1, got {max_hashes_per_worker!r}")
        self.max_hashes_per_worker = max_hashes_per_worker
        self._held: dict[str, dict[bytes, None]] = {}

    def apply(self, worker: str, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Apply one event batch: `stored` hashes are now held, `removed` ones no longer are.

        The two lists must be disjoint (as `drain_events` makes them). A worker seen for the first time
        starts empty. A re-stored hash counts as newly reported for the cap.
        """
        _check_worker(worker)
        stored, removed = _checked(stored, "stored"), _checked(removed, "removed")
        both = set(stored).intersection(removed)
        if both:
            raise ValueError(f"worker {worker!r}: {len(both)} hashes are both stored and removed in one "
                             f"batch (e.g. {next(iter(both)).hex()}); a batch's lists must be disjoint")
        held = self._held.setdefault(worker, {})
        for h in removed:
            held.pop(h, None)
        for h in stored:
            held.pop(h, None)  # re-insert at the newest end
            held[h] = None
        self._trim(held)

    def replace(self, worker: str, hashes: Iterable[bytes]) -> None:
        """Replace a worker's whole set with a snapshot; given in the worker's order, oldest first."""
        _check_worker(worker)
        held = dict.fromkeys(_checked(hashes, "snapshot"))
        self._trim(held)
        self._held[worker] = held

    def drop(self, worker: str) -> None:
        """Forget a worker (it left, died, or will resend a snapshot). Unknown workers are ignored."""
        self._held.pop(worker, None)

    def matched_pages(self, worker: str, hashes: Sequence[bytes]) -> int:
        """The length of the longest leading run of `hashes` the worker holds (0 for an unknown worker)."""
        held = self._held.get(worker)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def workers(self) -> list[str]:
        return sorted(self._held)

    def num_hashes(self, worker: str) -> int:
        return len(self._held.get(worker, ()))

    def _trim(self, held: dict[bytes, None]) -> None:
        excess = len(held) - self.max_hashes_per_worker
        if excess > 0:
            for h in list(islice(held, excess)):  # the oldest reports
                del held[h]


def _check_worker(worker: str) -> None:
    if not isinstance(worker, str) or not worker:
        raise ValueError(f"a worker name must be a non-empty string, got {worker!r}")


def _checked(hashes: Iterable[bytes], what: str) -> list[bytes]:
    out = list(hashes)
    for i, h in enumerate(out):
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ValueError(f"{what}[{i}] is not a {HASH_BYTES}-byte page hash (tandem.prefix): {h!r:.40}")
    return out


class PrefixView:
    """Every worker's prefix cache as its stats pushes describe it (one Watch per worker, this process's own)."""

    def __init__(self, tokens_per_page: int, index: PrefixIndex | None = None):
        self.tokens_per_page = tokens_per_page
        self.index = index or PrefixIndex()
        self.salts: dict[str, bytes] = {}  # worker -> the salt its pages are named with

    def observe(self, worker: str, stats) -> None:
        """Apply one push (a tandem.wire.WorkerStats). A worker whose cache is off holds nothing; a
        malformed report makes the view forget the worker (advisory: it costs cache-blind routing only)."""
        if not stats.engine_salt:
            self.forget(worker)
            return
        try:
            salt = _hashes([stats.engine_salt], "engine_salt")[0]
            stored, removed = _hashes(stats.stored, "stored"), _hashes(stats.removed, "removed")
            if stats.resync:
                self.index.replace(worker, stored)
            else:
                self.index.apply(worker, stored, removed)
        except ValueError as e:
            log.warning("worker %s sent an unreadable prefix-cache report (%s); routing ignores its cache", worker, e)
            self.forget(worker)
            return
        self.salts[worker] = salt

    def forget(self, worker: str) -> None:
        self.index.drop(worker)
        self.salts.pop(worker, None)

    def lookup(self, token_ids: Sequence[int], cache_salt: str = "", lora: str = "") -> "PrefixLookup":
        """`cache_salt`, `lora`: the request's (SamplingParams'); it matches only pages cached under both."""
        return PrefixLookup(self, list(token_ids), cache_salt, lora)


class PrefixLookup:
    """One request's question to the view: how many of its leading tokens does a worker hold?

    At most all but the last token count (the worker computes that one to get the next token), the
    same rule the worker's own match follows (engine/prefix_cache.py)."""

    def __init__(self, view: PrefixView, token_ids: list[int], cache_salt: str, lora: str = ""):
        self.view, self.token_ids, self.cache_salt, self.lora = view, token_ids, cache_salt, lora
        self._hashes: dict[bytes, list[bytes]] = {}  # per engine salt: computed once per request

    def tokens(self, worker: str) -> int:
        salt = self.view.salts.get(worker)
        if salt is None:
            return 0
        tpp = self.view.tokens_per_page
        if salt not in self._hashes:
            usable = max(0, len(self.token_ids) - 1) // tpp
            chain = tenant_salt(salt, self.cache_salt, self.lora)
            self._hashes[salt] = page_hashes(self.token_ids, tpp, chain, limit=usable)
        return self.view.index.matched_pages(worker, self._hashes[salt]) * tpp


def _hashes(items: list[str], what: str) -> list[bytes]:
    """Hex hashes as WorkerStats carries them (one per item) -> bytes; ValueError naming the field."""
    bad = next((i for i, h in enumerate(items) if not isinstance(h, str) or len(h) != HEX_CHARS), None)
    if bad is not None:
        raise ValueError(f"{what}[{bad}] is not {HEX_CHARS} hex digits")
    return hashes_from_hex("".join(items), what)
