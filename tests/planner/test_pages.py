"""Page budgets: never more pages reserved than a pool has; requests wait for pages instead."""

from __future__ import annotations

import pytest

from planner.sim.sim_layouts import Layout
from planner.sim.sim_run import simulate
from planner.plan_workload import Fixed, Poisson, RequestSpec, Workload, draw
from tests.planner.toy import toy_profile

TOKENS_PER_PAGE = 16
POOL_PAGES = 40  # kv_pool_bytes / (kv_bytes_per_token * tokens_per_page)


def _profile():
    return toy_profile(prefill={"intercept_s": 0.01, "per_token_s": 0.0}, decode={"intercept_s": 0.01},
                       serving={"kv_pool_bytes": POOL_PAGES * TOKENS_PER_PAGE * 1000})


@pytest.mark.parametrize("layout", [Layout("disaggregated", 2, 2), Layout("colocated", 2), Layout("chunked", 2)],
                         ids=lambda x: x.name)
def test_reserved_pages_never_exceed_the_pool(layout):
    # 100 requests of 64 + 64 tokens (8 pages each) arriving ~100x faster than they are served
    w = Workload(prompt=Fixed(value=64), output=Fixed(value=64), arrivals=Poisson(rate=1000.0), requests=100, seed=3)
    run = simulate(_profile(), layout, draw(w), trace_pages=True)
    for pool in run.pools:
        assert pool.num_pages == POOL_PAGES
        assert max(used for _, used in pool.trace) <= POOL_PAGES
        assert pool.peak == POOL_PAGES  # 5 requests of 8 pages fill it exactly: the budget really bound
        assert pool.used == 0
    assert all(r.finished for r in run.requests)
    waited = [r for r in run.requests if r.reserved_at > r.arrival]
    assert len(waited) > 50


def test_request_larger_than_a_pool_is_refused_with_the_reason():
    run = simulate(_profile(), Layout("disaggregated", 1, 1), [RequestSpec(600, 100, 0.0), RequestSpec(10, 2, 0.0)])
    big, small = run.requests
    assert big.failed == "needs 44 KV pages; a decode worker's whole pool has 40"
    assert small.finished
