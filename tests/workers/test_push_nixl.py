"""The push handoff's fence over NIXL in the workers (one process, two real NIXL agents over UCX, real
model): a lease that ends while its one-sided writer may still write waits in FENCING for the writer's
close notice, and an otherwise idle decode worker still polls for it."""

from __future__ import annotations

import contextlib
import time

import pytest

from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.kv_pool import KVCache
from engine.transports.host import PoolHost
from engine.transports.nixl import available as nixl_available
from engine.workers.decode_worker import DecodeWorker
from engine.workers.prefill_worker import PrefillWorker
from tandem.sampling_params import SamplingParams
from tandem.status import Cancelled
from tandem.wire import Prefill, Release
from tests.workers.test_handoff import ListSink, reserve, wait_until

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed (pip install --no-deps nixl-cu12)")


@contextlib.contextmanager
def nixl_pair(engine, write_delay_s: float = 0.0):
    """A prefill worker and a decode worker (64 pages, fence timeout 30 s) over NIXL in this process:
    (prefill, decode, the decode worker's engine), closed on exit."""
    model, tok, layout = engine.model, engine.tokenizer, engine.cache.layout
    d_engine = Engine(model, tok, KVCache(layout, 64), identity=engine.identity)
    d_host = PoolHost(d_engine.cache, ("nixl",))
    decode = DecodeWorker(d_engine, d_host, transfer_timeout_s=10.0, fence_timeout_s=30.0).launch()
    prefill = PrefillWorker(Engine(model, tok, None, identity=engine.identity), write_delay_s=write_delay_s).launch()
    try:
        yield prefill, decode, d_engine
    finally:
        prefill.close()
        decode.close()
        d_host.close()


def assert_pages_back_by_the_notice(decode, d_engine, since: float) -> None:
    assert wait_until(lambda: d_engine.allocator.num_used == 0 and not decode.fencing, 20)
    took = time.monotonic() - since
    assert took < 10, f"the pages came back after {took:.1f}s: at the fence timeout, not at the notice"


def test_an_idle_decode_worker_frees_a_fenced_lease_at_its_writers_close_notice(default_engine):
    """A request released while its prefill is still writing over NIXL (writers slowed to 0.1 s a layer):
    its decode pages wait in FENCING. The prefill is then aborted and its writer sends its close notice;
    nothing else runs on the decode worker, yet the pages come back within seconds, not at the fence
    timeout (30 s here)."""
    with nixl_pair(default_engine, write_delay_s=0.1) as (prefill, decode, d_engine):
        ids = default_engine.tokenizer.encode("Tell me about the history of the Roman empire in detail.")
        params = SamplingParams(max_tokens=4)
        reserved, dsink = reserve(decode, ids, params, "gone")
        assert reserved.destination.transport == "nixl"
        psink = ListSink()
        prefill.submit(Prefill("gone", ids, params, destination=reserved.destination), psink)
        time.sleep(0.5)  # a few layers written
        decode.release(Release("gone", reserved.lease, writer_closed=False))
        assert dsink.finished.wait(10) and wait_until(lambda: bool(decode.fencing))
        assert d_engine.allocator.num_used > 0  # held out of use while the writer may still write
        assert prefill.abort("gone").found
        t0 = time.monotonic()
        assert psink.finished.wait(10) and isinstance(psink.error, Cancelled)
        assert_pages_back_by_the_notice(decode, d_engine, t0)


def test_a_prefill_refused_by_its_worker_still_closes_its_destination(default_engine):
    """A Prefill the prefill worker refuses (a token outside the vocabulary here: a request valid at the
    edge but not on this worker is the case in service) never writes, yet its writer is opened and
    closed, so the decode lease hears `closed`. Released without `writer_closed` (the orchestrator's
    client left before the refusal arrived), its pages come back at once, not at the fence timeout."""
    with nixl_pair(default_engine) as (prefill, decode, d_engine):
        ids = default_engine.tokenizer.encode("Tell me about the history of the Roman empire in detail.")
        params = SamplingParams(max_tokens=4)
        reserved, dsink = reserve(decode, ids, params, "refused")
        with pytest.raises(InvalidRequest, match="token ids must be in"):
            prefill.submit(Prefill("refused", [*ids[:-1], 10 ** 9], params, destination=reserved.destination),
                           ListSink())
        assert not prefill.abort("refused").found  # the orchestrator's Abort finds nothing to stop
        t0 = time.monotonic()
        decode.release(Release("refused", reserved.lease, writer_closed=False))
        assert dsink.finished.wait(10)
        assert_pages_back_by_the_notice(decode, d_engine, t0)
