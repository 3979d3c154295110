"""KV pools sized to GPU memory (`gpu_memory_utilization`, vLLM's flag; ops/gpu_plan.py), as arithmetic:
GPU memory sizes are given, so this runs on any machine; what a real GPU reports is read by
`gpu_totals` on the first one lent. The weights are the session's real engines'."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.deployment import DeploymentError, load_deployment
from ops.gpu_plan import (DEFAULT_GPU_MEMORY_UTILIZATION, MIN_POOL_BYTES, PROCESS_OVERHEAD_BYTES, planned_bytes,
                          pools_within, sized_pools, weight_bytes)
from tandem.devices import DeviceError
from tandem.manifest import read_manifest

GiB = 1 << 30


def test_one_gpu_shared_by_prefill_and_decode_splits_what_the_weights_leave():
    weights = {"prefill": 16 * GiB, "decode": 16 * GiB}
    pools = pools_within({"prefill": (0,), "decode": (0,)}, {"prefill": 1, "decode": 1}, weights, {0: 80 * GiB}, 0.9, {})
    left = int(0.9 * 80 * GiB) - 32 * GiB - 2 * PROCESS_OVERHEAD_BYTES
    assert pools == {"prefill": left // 2, "decode": left // 2}
    # a prefill pool given in bytes: decode takes the rest
    pools = pools_within({"prefill": (0,), "decode": (0,)}, {"prefill": 1, "decode": 1}, weights, {0: 80 * GiB}, 0.9,
                         {"prefill": 4 * GiB})
    assert pools == {"decode": left - 4 * GiB}


def test_a_role_takes_its_smallest_share_over_its_gpus():
    # GPU 0: one prefill and one decode worker; GPU 1: one decode worker alone
    gpus, counts = {"prefill": (0,), "decode": (0, 1)}, {"prefill": 1, "decode": 2}
    weights, totals = {"prefill": 2 * GiB, "decode": 2 * GiB}, {0: 24 * GiB, 1: 24 * GiB}
    pools = pools_within(gpus, counts, weights, totals, 0.5, {})
    shared = (12 * GiB - 2 * (2 * GiB + PROCESS_OVERHEAD_BYTES)) // 2
    assert pools == {"prefill": shared, "decode": shared}  # decode-1 could have more; one size per role
    assert all(need <= 0.5 * totals[g] for g, need in planned_bytes(gpus, counts, weights, pools).items())


def test_weights_that_leave_no_room_are_refused_naming_the_gpu():
    with pytest.raises(DeviceError, match=r"GPU 1 \(16.0 GiB\) leaves 0.00 GiB at gpu_memory_utilization 0.9 for "
                                          r"the KV pools of its 2 worker\(s\) after weights \(16.0 GiB\), and 1 GiB each"):
        pools_within({"decode": (1,)}, {"decode": 2}, {"decode": 8 * GiB}, {1: 16 * GiB}, 0.9, {})
    # a GPU holding only pools given in bytes, more than its share: refused too, not left unchecked
    with pytest.raises(DeviceError, match=r"GPU 0 .* its 0 worker\(s\) after weights \(0.0 GiB\), pools given in "
                                          r"bytes \(6.0 GiB\), and 1 GiB each for CUDA and Triton of its 2"):
        pools_within({"prefill": (0,), "decode": (1,)}, {"prefill": 2, "decode": 1}, {}, {0: 16 * GiB, 1: 16 * GiB},
                     0.25, {"prefill": 3 * GiB})


@settings(max_examples=300, deadline=None)
@given(n_gpus=st.integers(1, 4), prefill=st.integers(0, 4), decode=st.integers(1, 4),
       weights=st.integers(0, 40 * GiB), total=st.sampled_from([16, 24, 40, 80, 141]),
       utilization=st.floats(0.05, 1.0), fixed=st.one_of(st.none(), st.integers(1 << 20, 8 * GiB)),
       spread=st.data())
def test_sized_pools_always_fit_the_utilization_or_are_refused(n_gpus, prefill, decode, weights, total, utilization,
                                                               fixed, spread):
    gpus = {r: tuple(spread.draw(st.lists(st.integers(0, n_gpus - 1), min_size=1, max_size=n_gpus), label=r))
            for r in ("prefill", "decode")}
    counts, totals = {"prefill": prefill, "decode": decode}, {g: total * GiB for g in range(n_gpus)}
    w = {"prefill": weights, "decode": weights}
    fixed_pools = {"prefill": fixed} if fixed else {}
    try:
        pools = pools_within(gpus, counts, w, totals, utilization, fixed_pools)
    except DeviceError as e:
        assert "raise gpu_memory_utilization, or spread the workers" in str(e)
        return
    assert all(p >= MIN_POOL_BYTES for p in pools.values())
    assert set(pools) == {r for r in ("prefill", "decode") if counts[r] and r not in fixed_pools}
    need = planned_bytes(gpus, counts, w, {**fixed_pools, **pools})
    assert all(need[g] <= utilization * totals[g] for g in need)


def test_the_deployment_sizes_pools_on_gpus_unless_given_in_bytes(built_engines):
    weights = weight_bytes(str(built_engines))
    gpus, counts, totals = {"prefill": (0,), "decode": (0,)}, {"prefill": 1, "decode": 1}, {0: 16 * GiB}
    sized = sized_pools(load_deployment(None, {}), str(built_engines), gpus, counts, totals)
    left = int(DEFAULT_GPU_MEMORY_UTILIZATION * 16 * GiB) - weights["prefill"] - weights["decode"] \
        - 2 * PROCESS_OVERHEAD_BYTES
    assert sized == {"prefill": left // 2, "decode": left // 2}
    half = sized_pools(load_deployment(None, {"gpu_memory_utilization": 0.5}), str(built_engines), gpus, counts, totals)
    assert half["decode"] < sized["decode"]
    # given in bytes: nothing sized, only checked against the GPU's memory
    assert sized_pools(load_deployment(None, {"kv_pool_bytes": 1 * GiB}), str(built_engines), gpus, counts, totals) == {}
    with pytest.raises(DeviceError, match="GPU 0 would hold .* lower kv_pool_bytes"):
        sized_pools(load_deployment(None, {"kv_pool_bytes": 15 * GiB}), str(built_engines), gpus, counts, totals)
    assert sized_pools(load_deployment(None, {}), str(built_engines), {}, counts, {}) == {}  # every worker on the CPU
    # decode on the GPU, prefill on the CPU: the prefill pool keeps its own size, not the GPU decode pool's
    mixed = sized_pools(load_deployment(None, {}), str(built_engines), {"decode": (0,)}, counts, totals)
    profile = load_deployment(None, {}).kv_pool_bytes or read_manifest(str(built_engines / "decode")).profile.kv_pool_bytes
    assert mixed["prefill"] == profile < mixed["decode"]


@pytest.mark.parametrize("fields, says", [
    ({"gpu_memory_utilization": 0.8, "kv_pool_bytes": 1 << 30}, "give one of the two"),
    ({"gpu_memory_utilization": 0}, "greater than 0"),
    ({"gpu_memory_utilization": 1.01}, "less than or equal to 1"),
    ({"gpu_memory_utilization": 0.8, "backend": "tensorrt-llm", "device": "cuda"}, "free_gpu_memory_fraction"),
])
def test_a_utilization_that_cannot_be_honoured_is_refused(fields, says):
    with pytest.raises(DeploymentError, match=says):
        load_deployment(None, fields)
