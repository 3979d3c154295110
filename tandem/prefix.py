"""Prefix-cache page hashes: the names under which full KV pages are cached and routed.

A full page of KV is fully determined by the engine that computed it and by every token id up to and
including the page's last token. So a page is named by a hash chained over the pages before it:

    h_0 = H(salt, tokens[0:tpp])        h_i = H(h_{i-1}, tokens[i*tpp:(i+1)*tpp])

where `salt = engine_salt(weights digest, KV layout)` keeps pages of different weights or layouts from
ever matching (a request's `cache_salt` is mixed in on top: `tenant_salt`, so pages are shared only
between requests that give the same one; under per-key isolation the salt is first scoped to the caller's
API key: `scoped_salt`), and H is BLAKE2b with a 16-byte digest and a project-specific personalization string.
Only full pages are named; a partial last page is never cached.

Collision odds: with N distinct pages ever named, the chance that any two share a hash is about
N^2 / 2^129 -- for a billion pages, about 1e-21. Finding a prompt whose page collides with a given
victim's page (a second preimage) costs about 2^128 work, so a client cannot make another client's
cached KV serve its prompt.

The hash is stable across processes, machines and Python versions (it does not use Python's `hash`),
because workers and the router compare hashes they computed independently. Wire form: the hex digits of
each hash, concatenated (`hashes_to_hex` / `hashes_from_hex`).

Imports only hashlib, json and struct: the router uses this module too.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

HASH_BYTES = 16  # 128-bit page hashes; see the collision odds above
HEX_CHARS = 2 * HASH_BYTES
_PAGE_PERSON = b"tandem-page-v1"  # bump the version if the page encoding ever changes
_SALT_PERSON = b"tandem-salt-v1"
_SCOPE_PERSON = b"tandem-scope-v1"
_TENANT_PERSON = b"tandem-tenant-v1"
_LORA_PERSON = b"tandem-lora-v1"
_TOKEN_MAX = 2**32 - 1  # token ids are encoded as little-endian uint32
_HEX_DIGITS = frozenset("0123456789abcdef")
_PAGE_BASE = hashlib.blake2b(digest_size=HASH_BYTES, person=_PAGE_PERSON)


class PrefixHashError(ValueError):
    """Bad input to a prefix-hash function; the message names the argument and what is allowed."""


def engine_salt(weights_digest: str, kv_layout_dict: dict) -> bytes:
    """The 16-byte identity mixed into every page hash of one engine.

    Two engines get the same salt exactly when their weights digest and KV layout (as a JSON object,
    e.g. `KVLayout.to_dict()`) are equal; key order in the dict does not matter. A prefill and a decode
    engine built from the same checkpoint with the same layout therefore share page hashes.
    """
    if not isinstance(weights_digest, str) or not weights_digest:
        raise PrefixHashError(f"weights_digest must be a non-empty string (e.g. 'sha256:...'), "
                              f"got {weights_digest!r}")
    if not isinstance(kv_layout_dict, dict) or not kv_layout_dict:
        raise PrefixHashError(f"kv_layout_dict must be a non-empty dict (KVLayout.to_dict()), "
                              f"got {type(kv_layout_dict).__name__}")
    try:
        layout = json.dumps(kv_layout_dict, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise PrefixHashError(f"kv_layout_dict must hold only JSON values with string keys: {e}") from None
    identity = json.dumps([weights_digest, layout]).encode()
    return hashlib.blake2b(identity, digest_size=HASH_BYTES, person=_SALT_PERSON).digest()


def tenant_salt(salt: bytes, cache_salt: str, lora: str = "") -> bytes:
    """The salt of one request's page chain: the engine's `salt` itself when `cache_salt` is empty, else
    a 16-byte hash of both, so requests with different cache salts (or none) never share a page: a
    tenant's cached prefix cannot serve, or be timed by, another tenant's prompt (vLLM's `cache_salt`).
    A request answered with a LoRA adapter (`lora`, its name) chains from a salt of the adapter's own
    first: its pages hold other K/V than the base model's, and no cache salt reaches them.
    """
    _check_hash(salt, "salt")
    if not isinstance(cache_salt, str) or not isinstance(lora, str):
        raise PrefixHashError(f"cache_salt and lora must be strings, got {type(cache_salt).__name__} and "
                              f"{type(lora).__name__}")
    if lora:
        salt = hashlib.blake2b(salt + lora.encode(), digest_size=HASH_BYTES, person=_LORA_PERSON).digest()
    if not cache_salt:
        return salt
    return hashlib.blake2b(salt + cache_salt.encode(), digest_size=HASH_BYTES, person=_TENANT_PERSON).digest()


def scoped_salt(scope: str, cache_salt: str) -> str:
    """The cache salt a request is served under when its caller's cache scope is `scope` (its API key
    holder's under per-key isolation, frontdoor/api_keys.py; "" for none): its own `cache_salt` when there is no
    scope, else the scope, followed by a digest of its own salt when it has one. Every salt under a scope
    starts with that scope and no client-chosen salt reaches the workers, so one caller cannot name
    another's pages. At most len(scope) + 33 characters.
    """
    if not scope:
        return cache_salt
    if not cache_salt:
        return scope
    return scope + "." + hashlib.blake2b(cache_salt.encode(), digest_size=HASH_BYTES, person=_SCOPE_PERSON).hexdigest()


def next_page_hash(prev: bytes, page_tokens: Sequence[int]) -> bytes:
    """The hash of one full page given the previous page's hash (the salt for page 0).

    The caller decides that the page is full: `page_tokens` must hold exactly tokens_per_page ids.
    """
    _check_hash(prev, "prev")
    h = _PAGE_BASE.copy()
    h.update(prev)
    h.update(_pack(page_tokens))
    return h.digest()


def page_hashes(token_ids: Sequence[int], tokens_per_page: int, salt: bytes,
                limit: int | None = None) -> list[bytes]:
    """One hash per full page of `token_ids`, in page order; at most `limit` of them when given."""
    return extend_page_hashes([], token_ids, tokens_per_page, salt, limit)


def extend_page_hashes(hashes: list[bytes], token_ids: Sequence[int], tokens_per_page: int, salt: bytes,
                       limit: int | None = None) -> list[bytes]:
    """Append to `hashes` the hashes of the full pages of `token_ids` beyond the first len(hashes).

    `hashes` must be what an earlier call computed for a prefix of the same `token_ids` (same page
    size and salt); this is how a sequence growing token by token keeps its hashes up to date at the
    cost of hashing only new pages. `limit` caps the total length of `hashes`. Returns the newly
    appended hashes (possibly none); `hashes` is extended in place.
    """
    _check_args(tokens_per_page, salt, limit)
    full = len(token_ids) // tokens_per_page
    if limit is not None:
        full = min(full, limit)
    start = len(hashes)
    if start >= full:
        return []
    data = _pack(token_ids[start * tokens_per_page: full * tokens_per_page])
    view, step = memoryview(data), 4 * tokens_per_page
    prev = hashes[-1] if hashes else salt
    new = []
    for off in range(0, len(data), step):
        h = _PAGE_BASE.copy()  # copying the keyed state beats constructing a new hasher per page
        h.update(prev)
        h.update(view[off:off + step])
        prev = h.digest()
        new.append(prev)
    hashes.extend(new)
    return new


def hashes_to_hex(hashes: Sequence[bytes]) -> str:
    """The wire form: each hash's 32 lowercase hex digits, concatenated in order ('' for none)."""
    for i, h in enumerate(hashes):
        _check_hash(h, f"hashes[{i}]")
    return b"".join(hashes).hex()


def hashes_from_hex(text: str, what: str = "page hashes") -> list[bytes]:
    """Parse `hashes_to_hex` output; `what` names the field in the error for a malformed string."""
    if not isinstance(text, str):
        raise PrefixHashError(f"{what}: expected a hex string, got {type(text).__name__}")
    if len(text) % HEX_CHARS:
        raise PrefixHashError(f"{what}: length {len(text)} is not a multiple of {HEX_CHARS} "
                              f"(each hash is {HEX_CHARS} hex digits)")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = None
    if raw is None or raw.hex() != text:  # fromhex also takes uppercase and spaces; the wire form does not
        bad = "".join(sorted(set(text) - _HEX_DIGITS))
        raise PrefixHashError(f"{what}: only lowercase hex digits 0-9a-f are allowed, found {bad[:16]!r}")
    return list(struct.unpack(f"{HASH_BYTES}s" * (len(raw) // HASH_BYTES), raw))


def _pack(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        bad = next((t for t in tokens if not hasattr(t, "__index__") or not 0 <= t <= _TOKEN_MAX), None)
        raise PrefixHashError(f"token ids must be integers in 0..{_TOKEN_MAX}, got {bad!r}") from None


def _check_args(tokens_per_page: int, salt: bytes, limit: int | None) -> None:
    if not isinstance(tokens_per_page, int) or tokens_per_page < 1:
        raise PrefixHashError(f"tokens_per_page must be an integer >= 1, got {tokens_per_page!r}")
    _check_hash(salt, "salt")
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise PrefixHashError(f"limit must be None or an integer >= 0, got {limit!r}")


def _check_hash(value: bytes, what: str) -> None:
    if not isinstance(value, bytes) or len(value) != HASH_BYTES:
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise PrefixHashError(f"{what} must be {HASH_BYTES} bytes (from engine_salt or page_hashes), got {got}")
