"""KV transports, chosen by name: `shm` (default, one host), `nixl` (NIXL/UCX), `inproc` (tests).

`endpoint(name, cache)` makes the decode side for a pool; `sender(name, layout)` the prefill side.
"""

from __future__ import annotations

from engine.kv_pool import KVCache
from engine.transports.base import KVSender, PoolEndpoint, TransferError
from tandem.kv_layout import KVLayout

TRANSPORTS = ("shm", "nixl", "inproc")


def _check(name: str) -> None:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; allowed: {', '.join(TRANSPORTS)}")


def endpoint(name: str, cache: KVCache, registry: dict | None = None) -> PoolEndpoint:
    _check(name)
    if name == "shm":
        from engine.transports.shm import ShmEndpoint

        return ShmEndpoint(cache)
    if name == "nixl":
        from engine.transports.nixl import NixlEndpoint

        return NixlEndpoint(cache)
    from engine.transports.inproc import InprocEndpoint

    return InprocEndpoint(cache, registry if registry is not None else {})


def sender(name: str, layout: KVLayout, registry: dict | None = None) -> KVSender:
    _check(name)
    if name == "shm":
        from engine.transports.shm import ShmSender

        return ShmSender(layout)
    if name == "nixl":
        from engine.transports.nixl import NixlSender

        return NixlSender(layout)
    from engine.transports.inproc import InprocSender

    return InprocSender(layout, registry if registry is not None else {})


__all__ = ["TRANSPORTS", "endpoint", "sender", "KVSender", "PoolEndpoint", "TransferError"]
