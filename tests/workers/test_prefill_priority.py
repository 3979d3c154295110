"""A real prefill worker serves its queue in turn: with priorities (the orchestrator sends non-zero ones
only under `scheduling_policy: priority`), the lowest value first, arrival order among equals, and each
first token is the one the prompt gets alone."""

from __future__ import annotations

import time

from tandem.sampling_params import SamplingParams
from tandem.wire import Prefill, Prefilled, Release
from tests.conftest import complete
from tests.workers.test_handoff import ListSink, reserve, wait_until, worker_pair


class TimedSink(ListSink):
    """A ListSink that notes when its answer came."""

    def send(self, body, final=False):
        if final:
            self.at = time.monotonic()
        super().send(body, final)


def test_queued_prompts_are_prefilled_by_priority_then_arrival(default_engine):
    tok = default_engine.tokenizer
    names = {"blocker": 0, "low": 5, "first-zero": 0, "urgent": -5, "second-zero": 0}
    prompts = {n: tok.encode(f"{n}: write a short line about the sea, please.") for n in names}
    assert all(len(p) <= 24 for p in prompts.values())
    with worker_pair(default_engine) as (prefill, decode):
        prefill.pass_tokens, prefill.write_delay_s = 24, 0.02  # one prompt a pass; a pass takes ~0.6 s
        sinks, leases = {}, {}
        for n, priority in names.items():
            params = SamplingParams(max_tokens=2, priority=priority)
            leases[n] = reserve(decode, prompts[n], params, n)[0]
            sinks[n] = TimedSink()
            prefill.submit(Prefill(n, prompts[n], params, destination=leases[n].destination), sinks[n])
            if n == "blocker":  # its pass starts; the others queue behind it
                assert wait_until(lambda: not prefill.queue)
        for n in names:
            assert sinks[n].finished.wait(60)
            first = sinks[n].replies[0]
            assert isinstance(first, Prefilled), sinks[n].error
            assert first.token == complete(default_engine, prompts[n], SamplingParams(max_tokens=1)).output_ids[0]
            decode.release(Release(n, leases[n].lease, writer_closed=True))
        assert sorted(names, key=lambda n: sinks[n].at) == ["blocker", "urgent", "first-zero", "second-zero", "low"]
