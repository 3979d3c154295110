"""The API keys a deployment gives its doors: read, named, checked against, rotated.

Keys come from `TANDEM_API_KEY` (one key) and/or a key file: one key a line, optionally followed by
the name of whoever holds it (`<key> tenant-a`); blank lines and `#` comments are skipped. Several keys
can be valid at once while one is rotated, and they are read again on SIGHUP (`ApiKeys.rotate`).

A request's caller is the key it presented, shown by its name (the access log, the per-key metrics),
never by the key; an unnamed key is shown as `key-` and 8 hex digits of its digest. Under per-key
prefix-cache isolation (`prefix_cache.per_api_key`) the caller's requests share cached prefixes only
among themselves: keys of one name share a scope (a holder's old and new key while it rotates them),
an unnamed key has a scope of its own (a digest of the key).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass

from tandem.secret import is_loopback

ENV_KEY = "TANDEM_API_KEY"
MIN_KEY_CHARS = 8
_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")


class ApiKeyError(ValueError):
    """Keys are configured wrongly: the message says what and how to fix it."""


@dataclass(frozen=True)
class Caller:
    name: str  # the key's name (its holder), or key-<8 hex digits> for an unnamed key
    scope: str  # the cache scope of its requests ("" when keys do not isolate cached prefixes)


@dataclass
class ApiKeys:
    """The doors' keys. `keys` and `names` may be replaced while serving (`rotate`, on SIGHUP); every
    request reads them once, so it is checked against the old set or the new one, never a mix."""

    keys: tuple[bytes, ...]
    names: tuple[str, ...] = ()  # one per key ("" for an unnamed one); () when none is named
    open_probes: bool = True
    per_key_cache: bool = False  # each caller's requests share cached prefixes only among themselves

    def caller(self, authorization: str | None) -> Caller | None:
        """Who sent 'Bearer <a configured key>' as `authorization`, else None. Compares every key."""
        scheme, _, given = (authorization or "").strip().partition(" ")
        token = given.strip().encode() if scheme.lower() == "bearer" else b""
        found = None
        for key, name in zip(self.keys, self.names or ("",) * len(self.keys)):
            if hmac.compare_digest(token, key):  # no early exit: every key is compared, every time
                found = name
        if found is None or not token:
            return None
        scope = ("name-" + found if found else _digest(token, b"tandem-api-key", 16)) if self.per_key_cache else ""
        return Caller(found or "key-" + _digest(token, b"tandem-key-name", 4), scope)

    def rotate(self, new: "ApiKeys | None") -> str:
        """Take the keys of `new` (the deployment's keys read again); returns what changed, in words
        (never a key). Raises ApiKeyError when `new` would switch keys off or change a rule that only
        a restart changes (open probes, per-key caching): the running keys are then kept."""
        if new is None:
            raise ApiKeyError("the reloaded deployment has no API keys; switching them off needs a restart")
        if (new.open_probes, new.per_key_cache) != (self.open_probes, self.per_key_cache):
            raise ApiKeyError("front_door.open_probes and prefix_cache.per_api_key change only with a restart")
        kept = len(set(new.keys) & set(self.keys))
        said = f"{len(new.keys)} API keys ({len(new.keys) - kept} new, {len(self.keys) - kept} removed)"
        self.keys, self.names = new.keys, new.names
        return said


def _digest(key: bytes, person: bytes, size: int) -> str:
    return hashlib.blake2b(key, digest_size=size, person=person).hexdigest()


def read_keys(key_file: str | None, environ=os.environ) -> tuple[tuple[bytes, str], ...]:
    """(key, name) of TANDEM_API_KEY and of each line of `key_file`; a key at least MIN_KEY_CHARS long
    without spaces, a name ("" when none) of 1-64 letters, digits and _ . : @ -."""
    lines = [environ[ENV_KEY].strip()] if environ.get(ENV_KEY) else []
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as f:
                lines += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        except OSError as e:
            raise ApiKeyError(f"cannot read the API key file {key_file}: {e.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        key, *name = line.split()
        if len(key) < MIN_KEY_CHARS or len(name) > 1 or (name and not _NAME.fullmatch(name[0])):
            raise ApiKeyError(f"API key {n} (counting TANDEM_API_KEY first): a key is at least {MIN_KEY_CHARS} "
                              f"characters with no spaces (e.g. `head -c 24 /dev/urandom | base64`), optionally "
                              f"followed by one name of 1-64 letters, digits and _ . : @ -")
        out.append((key.encode(), name[0] if name else ""))
    return tuple(out)


def resolve_keys(host: str, key_file: str | None, disabled: bool, open_probes: bool = True,
                 per_key_cache: bool = False, environ=os.environ) -> ApiKeys | None:
    """The keys the doors on `host` require, or None (no keys). Off loopback, keys are required unless
    `disabled`; keys given while `disabled` is a contradiction, refused too; so is `per_key_cache`
    (prefix-cache isolation per key) without keys."""
    read = read_keys(key_file, environ)
    if per_key_cache and (disabled or not read):
        raise ApiKeyError("prefix_cache.per_api_key isolates cached prefixes per API key and no keys are "
                          "configured: set TANDEM_API_KEY or --api-key-file, or leave per_api_key off")
    if disabled:
        if read:
            raise ApiKeyError("API keys are given (TANDEM_API_KEY or an API key file) and switched off "
                              "(--no-api-key) at once; choose one")
        return None
    if not read:
        if not is_loopback(host):
            raise ApiKeyError(f"the front doors listen on {host}, beyond loopback, without API keys: set "
                              f"TANDEM_API_KEY or --api-key-file, or pass --no-api-key to serve without keys")
        return None
    return ApiKeys(tuple(key for key, _ in read), tuple(name for _, name in read), open_probes, per_key_cache)
