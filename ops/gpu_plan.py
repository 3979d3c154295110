"""Which device, and which GPU, each local worker gets; what GPUs its process may see.

A role runs on the deployment's `device` unless it names its own (`prefill: {device: cuda, gpus: [0, 1]}`);
resolving happens once, before anything starts, so `--device cuda` without CUDA is refused at once
(tandem/devices.py). Worker i of a CUDA role takes `gpus[i % len(gpus)]` (default: every visible GPU),
so several workers may share one GPU: 1P1D on one GPU is `gpus: [0]` for both roles. Nothing
partitions a shared GPU's memory, so `tandem serve` refuses a plan whose workers' weights, KV pools and
a per-process allowance exceed a GPU's memory (`check_fits`), before it starts them.

Each worker's process sees its own GPU as CUDA device 0 (CUDA_VISIBLE_DEVICES; the rendered repository
says `KIND_GPU gpus: [ 0 ]` for every GPU model). A prefill worker also sees the decode workers' GPUs
after its own, because CUDA IPC can open a peer's pool only on a GPU the opener can see
(engine/transports/cuda_ipc.py); decode workers see their GPU alone.
"""

from __future__ import annotations

import os

from ops.deployment import Deployment
from tandem.devices import DeviceError, cuda_device_count, resolve_device
from tandem.roles import Role


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
    peers = gpus.get(Role.DECODE, ()) if role == Role.PREFILL else ()
    return {"CUDA_VISIBLE_DEVICES": visible_devices(own, peers)}


PROCESS_OVERHEAD_BYTES = 1 << 30  # per worker on a GPU: CUDA context, Triton's CUDA memory pool, activations


def planned_bytes(gpus: dict[str, tuple[int, ...]], counts: dict[str, int], weights: dict[str, int],
                  pools: dict[str, int]) -> dict[int, int]:
    """What each GPU must hold for the local workers placed on it: per worker its role's weights and KV
    pool (`weights`, `pools`: bytes per role) and PROCESS_OVERHEAD_BYTES."""
    need: dict[int, int] = {}
    for role, n in counts.items():
        for i in range(n):
            g = worker_gpu(gpus, role, i)
            if g is not None:
                need[g] = need.get(g, 0) + weights.get(role, 0) + pools.get(role, 0) + PROCESS_OVERHEAD_BYTES
    return need


def check_fits(need: dict[int, int], total: dict[int, int]) -> None:
    """DeviceError naming the first GPU whose workers' weights and pools exceed its memory."""
    for g, n in sorted(need.items()):
        if n > total.get(g, 0):
            raise DeviceError(f"GPU {g} would hold {n / 2**30:.1f} GiB for its workers (weights, KV pools and "
                              f"{PROCESS_OVERHEAD_BYTES >> 30} GiB each for CUDA and Triton) but has "
                              f"{total.get(g, 0) / 2**30:.1f} GiB; lower kv_pool_bytes or "
                              f"prefix_cache.prefill_pool_bytes, or spread the workers over more GPUs (gpus: [...])")


def gpu_totals(gpus: dict[str, tuple[int, ...]]) -> dict[int, int]:
    """Total memory of every GPU in the plan (read from the device properties; allocates nothing)."""
    import torch

    return {g: torch.cuda.get_device_properties(g).total_memory for mine in gpus.values() for g in mine}


def role_bytes(dep: Deployment, engines: str) -> tuple[dict[str, int], dict[str, int]]:
    """(weights, KV pool) bytes per role for the deployment's engines, as the workers will allocate them."""
    from tandem.manifest import read_manifest

    manifests = {r: read_manifest(os.path.join(engines, r)) for r in ("prefill", "decode")}
    weights = {r: sum(os.path.getsize(os.path.join(engines, r, f)) for f in m.weight_files)
               for r, m in manifests.items()}
    weights[Role.GENERATE] = weights[Role.PREFILL]  # the co-located worker runs the prefill engine
    pool = dep.kv_pool_bytes if dep.kv_pool_bytes is not None else manifests["decode"].profile.kv_pool_bytes
    cache = dep.prefix_cache
    prefill = (cache.prefill_pool_bytes or pool) if cache.enabled else 0  # a GPU prefill pool serves the cache
    return weights, {Role.PREFILL: prefill, Role.DECODE: pool, Role.GENERATE: pool}
