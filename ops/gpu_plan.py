"""Which device, and which GPU, each local worker gets; what GPUs its process may see.

A role runs on the deployment's `device` unless it names its own (`prefill: {device: cuda, gpus: [0, 1]}`);
resolving happens once, before anything starts, so `--device cuda` without CUDA is refused at once
(tandem/devices.py). Worker i of a CUDA role takes `gpus[i % len(gpus)]` (default: every visible GPU),
so several workers may share one GPU: 1P1D on one GPU is `gpus: [0]` for both roles (size
`kv_pool_bytes` and `prefix_cache.prefill_pool_bytes` so that both engines' weights and pools fit).

Each worker's process sees its own GPU as CUDA device 0 (CUDA_VISIBLE_DEVICES; the rendered repository
says `KIND_GPU gpus: [ 0 ]` for every GPU model). A prefill worker also sees the decode workers' GPUs
after its own, because CUDA IPC can open a peer's pool only on a GPU the opener can see
(engine/transports/cuda_ipc.py); decode workers see their GPU alone.
"""

from __future__ import annotations

import os

from ops.deployment import Deployment
from tandem.devices import cuda_device_count, resolve_device


def role_gpus(dep: Deployment, counts: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The GPUs (the launching process's numbering) that each CUDA role's local workers take in turn; roles
    on the CPU, or with no local worker, are absent. DeviceError when CUDA is asked for and not usable."""
    out = {}
    for role, n in counts.items():
        if n == 0:
            continue
        gpus = dep.role_gpus(role)
        if resolve_device(dep.role_device(role), gpus) == "cuda":
            out[role] = tuple(gpus) or tuple(range(cuda_device_count()))
    return out


def worker_gpu(gpus: dict[str, tuple[int, ...]], role: str, index: int) -> int | None:
    """The GPU of worker `index` of `role`, or None for a CPU worker."""
    mine = gpus.get(role)
    return mine[index % len(mine)] if mine else None


def visible_devices(own: int, peers: tuple[int, ...] = (), parent: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for a worker on GPU `own` (this process's numbering) that must also see `peers`.

    `parent` is this process's own CUDA_VISIBLE_DEVICES (default: read from the environment): indices
    are positions in it, so a deployment run under CUDA_VISIBLE_DEVICES=2,3 gives its workers 2 and 3.
    """
    parent = os.environ.get("CUDA_VISIBLE_DEVICES") if parent is None else parent
    names = [x.strip() for x in parent.split(",") if x.strip()] if parent else None
    order = [own] + sorted({p for p in peers if p != own})
    return ",".join(names[g] if names is not None and g < len(names) else str(g) for g in order)


def worker_env(gpus: dict[str, tuple[int, ...]], role: str, index: int) -> dict[str, str]:
    """The environment that places worker `index` of `role` on its GPU (empty for a CPU worker)."""
    own = worker_gpu(gpus, role, index)
    if own is None:
        return {}
    peers = gpus.get("decode", ()) if role == "prefill" else ()
    return {"CUDA_VISIBLE_DEVICES": visible_devices(own, peers)}
