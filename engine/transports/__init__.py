"""KV transports, chosen by name from one registry: `shm` (one host, host memory), `cuda_ipc` (one host,
GPU memory), `nixl` (NIXL/UCX, across hosts; host or GPU memory), `inproc` (tests).

`endpoint(name, ...)` makes the decode side of one transport; `sender(name, layout)` the prefill side;
`PoolHost` (host.py) is a decode worker's pool with every transport it offers and the fence. A name
that is unknown, or a transport this process cannot use (NIXL not installed, no CUDA), raises
`TransportUnavailable` naming what is missing.
"""

from __future__ import annotations

import importlib

from engine.kv_pool import KVCache
from engine.transports.base import KVSender, LayerWriter, Notices, PoolEndpoint, TransferState
from tandem.kv_layout import KVLayout
from tandem.status import TransferFailed

# name -> (module, decode side, prefill side); modules are imported only when their transport is used
_REGISTRY = {
    "shm": ("engine.transports.shm", "ShmEndpoint", "ShmSender"),
    "cuda_ipc": ("engine.transports.cuda_ipc", "CudaIpcEndpoint", "CudaIpcSender"),
    "nixl": ("engine.transports.nixl", "NixlEndpoint", "NixlSender"),
    "inproc": ("engine.transports.inproc", "InprocEndpoint", "InprocSender"),
}
TRANSPORTS = tuple(_REGISTRY)


class TransportUnavailable(TransferFailed):
    """An unknown transport name, or one this process cannot use; the message says which and why."""


def _side(name: str, index: int):
    if name not in _REGISTRY:
        raise TransportUnavailable(f"unknown transport {name!r}; allowed: {', '.join(TRANSPORTS)}")
    module = importlib.import_module(_REGISTRY[name][0])
    why = module.unavailable()
    if why:
        raise TransportUnavailable(f"transport {name} cannot be used here: {why}")
    return getattr(module, _REGISTRY[name][index])


def endpoint(name: str, cache: KVCache, fence_name: str, registry: dict | None = None) -> PoolEndpoint:
    """The decode side of transport `name` over `cache`; TransportUnavailable if it cannot be made here."""
    cls = _side(name, 1)
    return cls(cache, fence_name, registry if registry is not None else {})


def sender(name: str, layout: KVLayout, registry: dict | None = None, device: str = "cpu") -> KVSender:
    """The prefill side of transport `name` for a prefill engine on `device` (where its K/V come from);
    TransportUnavailable if it cannot be made here (e.g. NIXL missing, no CUDA for cuda_ipc)."""
    cls = _side(name, 2)
    return cls(layout, registry if registry is not None else {}, device)


__all__ = ["TRANSPORTS", "TransportUnavailable", "endpoint", "sender", "KVSender", "LayerWriter", "Notices",
           "PoolEndpoint", "TransferState"]
