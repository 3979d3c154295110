"""KV transports, chosen by name: `shm` (one host), `nixl` (NIXL/UCX, across hosts), `inproc` (tests).

`endpoint(name, ...)` makes the decode side of one transport; `sender(name, layout)` the prefill side;
`PoolHost` (host.py) is a decode worker's pool with every transport it offers and the fence.
"""

from __future__ import annotations

from engine.kv_pool import KVCache
from engine.transports.base import KVSender, LayerWriter, Notices, PoolEndpoint, TransferState
from tandem.kv_layout import KVLayout
from tandem.status import TransferFailed

TRANSPORTS = ("shm", "nixl", "inproc")


def _check(name: str) -> None:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; allowed: {', '.join(TRANSPORTS)}")


def endpoint(name: str, cache: KVCache, fence_name: str, registry: dict | None = None) -> PoolEndpoint:
    _check(name)
    if name == "shm":
        from engine.transports.shm import ShmEndpoint

        return ShmEndpoint(cache, fence_name)
    if name == "nixl":
        from engine.transports.nixl import NixlEndpoint

        return NixlEndpoint(cache)
    from engine.transports.inproc import InprocEndpoint

    return InprocEndpoint(cache, fence_name, registry if registry is not None else {})


def sender(name: str, layout: KVLayout, registry: dict | None = None) -> KVSender:
    """The prefill side of a transport; TransferFailed if it cannot be made here (e.g. NIXL missing)."""
    if name not in TRANSPORTS:
        raise TransferFailed(f"unknown transport {name!r}; allowed: {', '.join(TRANSPORTS)}")
    if name == "shm":
        from engine.transports.shm import ShmSender

        return ShmSender(layout)
    if name == "nixl":
        from engine.transports.nixl import NixlSender

        return NixlSender(layout)
    from engine.transports.inproc import InprocSender

    return InprocSender(layout, registry if registry is not None else {})


__all__ = ["TRANSPORTS", "endpoint", "sender", "KVSender", "LayerWriter", "Notices", "PoolEndpoint",
           "TransferState"]
