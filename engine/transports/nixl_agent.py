"""NIXL plumbing shared by the push transport (engine/transports/nixl.py) and the pull reader
(engine/transports/pull_nixl.py): making an agent, block descriptors, and the notices peers send a pool.

NIXL is imported only when an agent is made (`nixl` or the `nixl_cu12` wheel); nothing here unpickles
anything from a peer (agent metadata travels base64 in our typed descriptors).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from tandem.pool import Destination, PullSource
from tandem.status import TransferFailed


def agent(name: str):
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError:
            raise TransferFailed("the nixl transport needs NIXL: pip install --no-deps nixl-cu12") from None
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def available() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12"))


def unavailable() -> str:
    return "" if available() else "NIXL is not installed (pip install --no-deps nixl-cu12)"


def memory_of(t: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor: ("VRAM", GPU index) or ("DRAM", 0)."""
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


def descs(agent, base: int, block_ids, block_bytes: int, memory: str = "DRAM", device_id: int = 0):
    ids = np.asarray(block_ids, dtype=np.uint64)
    rows = np.stack([base + ids * np.uint64(block_bytes), np.full(len(ids), block_bytes, np.uint64),
                     np.full(len(ids), device_id, np.uint64)], axis=1)  # (address, length, device id)
    return agent.get_xfer_descs(rows, memory)


def notice(kind: str, dest: Destination | PullSource, request_id: str) -> bytes:
    """A peer's notice to the pool: `done` (a writer's every layer landed) or `closed` (a writer aborted,
    or a pull reader's READs ended: nothing of it is in flight)."""
    return f"{kind}:{dest.slot}:{dest.epoch}:{request_id}".encode()


def parse_notice(raw: bytes) -> tuple[str, int, int, str] | None:
    try:
        kind, slot, epoch, rid = raw.decode("utf-8").split(":", 3)
        if kind in ("done", "closed"):
            return kind, int(slot), int(epoch), rid
    except (UnicodeDecodeError, ValueError):
        pass  # a malformed notice carries no information we could act on
    return None
