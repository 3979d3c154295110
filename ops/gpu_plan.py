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

KV pools on GPUs are sized as vLLM sizes its cache (`gpu_memory_utilization`, default 0.9) unless the
deployment gives them in bytes (`kv_pool_bytes`): the workers on a GPU together take at most that
fraction of its memory, and what their weights and per-process allowances leave is shared equally by
their pools (`pools_within`).
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
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default: what Tandem's workers on a GPU may take of its memory
MIN_POOL_BYTES = 64 << 20  # a sized pool smaller than this is a plan that cannot serve: refused


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


def pools_within(gpus: dict[str, tuple[int, ...]], counts: dict[str, int], weights: dict[str, int],
                 totals: dict[int, int], utilization: float, fixed: dict[str, int]) -> dict[str, int]:
    """KV pool bytes per CUDA role, not in `fixed`, such that on every GPU its workers' weights, pools and
    PROCESS_OVERHEAD_BYTES together stay within `utilization` of its memory (`totals`).

    On each GPU, what is left after its workers' weights and allowances and the pools of `fixed` roles
    (bytes per worker) is shared equally by its other workers' pools; one size per role, so a role takes
    its smallest share over its GPUs. DeviceError naming the GPU when nothing, or under 64 MiB a pool, is left.
    """
    share: dict[int, int] = {}
    for g in sorted({g for mine in gpus.values() for g in mine}):
        on = [role for role, n in counts.items() for i in range(n) if worker_gpu(gpus, role, i) == g]
        taken = sum(weights.get(r, 0) + PROCESS_OVERHEAD_BYTES + fixed.get(r, 0) for r in on)
        sharing = sum(r not in fixed for r in on)
        left = int(utilization * totals[g]) - taken
        if left < 0 or (sharing and left // sharing < MIN_POOL_BYTES):
            given = sum(fixed.get(r, 0) for r in on)
            raise DeviceError(f"GPU {g} ({totals[g] / 2**30:.1f} GiB) leaves {max(left, 0) / 2**30:.2f} GiB at "
                              f"gpu_memory_utilization {utilization} for the KV pools of its {sharing} worker(s) after "
                              f"weights ({sum(weights.get(r, 0) for r in on) / 2**30:.1f} GiB), "
                              + (f"pools given in bytes ({given / 2**30:.1f} GiB), " if given else "")
                              + f"and {PROCESS_OVERHEAD_BYTES >> 30} GiB each for CUDA and Triton of its {len(on)}; "
                              "raise gpu_memory_utilization, or spread the workers over more GPUs (gpus: [...])")
        if sharing:
            share[g] = left // sharing
    return {role: min(share[worker_gpu(gpus, role, i)] for i in range(counts[role]))
            for role in gpus if role not in fixed and counts.get(role)}


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


def weight_bytes(engines: str) -> dict[str, int]:
    """Bytes of weights each role's worker loads from the engines folder."""
    from tandem.manifest import read_manifest

    weights = {r: sum(os.path.getsize(os.path.join(engines, r, f))
                      for f in read_manifest(os.path.join(engines, r)).weight_files)
               for r in (Role.PREFILL, Role.DECODE)}
    weights[Role.GENERATE] = weights[Role.PREFILL]  # the co-located worker runs the prefill engine
    return weights


def role_bytes(dep: Deployment, engines: str) -> tuple[dict[str, int], dict[str, int]]:
    """(weights, KV pool) bytes per role for the deployment's engines, as the workers will allocate them,
    with the pools given in bytes or the decode profile's (what `sized_pools` does not size)."""
    from tandem.manifest import read_manifest

    pool = dep.kv_pool_bytes if dep.kv_pool_bytes is not None else \
        read_manifest(os.path.join(engines, "decode")).profile.kv_pool_bytes
    # a prefill worker holds a pool for long prompts' chunks, its prefix cache and pull holds
    return weight_bytes(engines), {Role.PREFILL: dep.prefix_cache.prefill_pool_bytes or pool, Role.DECODE: pool,
                                   Role.GENERATE: pool}


def sized_pools(dep: Deployment, engines: str, gpus: dict[str, tuple[int, ...]], counts: dict[str, int],
                totals: dict[int, int]) -> dict[str, int]:
    """The KV pool bytes of the local CUDA roles, sized to `gpu_memory_utilization` of the GPUs' memory
    (`totals`, e.g. gpu_totals(gpus); pools_within), and then a CPU prefill role's own; {} when the
    deployment gives them in bytes (kv_pool_bytes) or no worker is on a GPU. Checks that every GPU holds
    its workers: DeviceError when they do not fit."""
    weights, pools = role_bytes(dep, engines)
    sized = {}
    if gpus and dep.kv_pool_bytes is None:
        fixed = {Role.PREFILL: dep.prefix_cache.prefill_pool_bytes} if dep.prefix_cache.prefill_pool_bytes else {}
        sized = pools_within(gpus, counts, weights, totals,
                             dep.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION, fixed)
    check_fits(planned_bytes(gpus, counts, weights, {**pools, **sized}), totals)
    if sized and Role.PREFILL not in sized and counts.get(Role.PREFILL):
        sized[Role.PREFILL] = pools[Role.PREFILL]  # on the CPU: its own size, not the GPU decode pool's it would follow
    return sized


def one_worker_pool(engines: str, role: str, gpu: int, utilization: float | None) -> int:
    """The KV pool bytes of one worker alone on GPU `gpu` (`tandem worker`), sized to `utilization` of its
    memory (default DEFAULT_GPU_MEMORY_UTILIZATION); DeviceError when its weights leave too little."""
    gpus = {role: (gpu,)}
    sized = pools_within(gpus, {role: 1}, weight_bytes(engines), gpu_totals(gpus),
                         utilization or DEFAULT_GPU_MEMORY_UTILIZATION, {})
    return sized[role]
