"""A simulated prefill worker and its KV link. Its passes are chosen by the prefill worker's own rules
(policies/prefill_passes.py: packed passes of whole prompts, chunks of long ones, alternating; by
priority when requests carry one); a long prompt part way through keeps its turn.

Handoff: K/V are written layer by layer while the pass computes, so the transfer is hidden behind
the pass except where the link is slower. The link is a FIFO resource of `gbytes_per_s`: a pass's
bytes (its tokens' KV) start moving at the pass's start (or when the link is free of the previous
pass's bytes) and the request's first token is ready at
    max(pass end, transfer end) + latency,
which for an idle link is pass end + max(0, kv_bytes / bandwidth - pass time) + latency. (The last
layer's share, ~1/num_layers of the bytes, cannot overlap a real pass; it is neglected.) A long
prompt's first token is ready when its last chunk's bytes have arrived.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from planner.costs import PassCosts
from policies.prefill_passes import PassTurn, chunk_tokens, in_turn, next_long, pack
from planner.sim.events import EventLoop
from planner.sim.request import SimRequest


class Link:
    """The prefill worker's outgoing KV link: one transfer at a time, in pass order."""

    def __init__(self, gbytes_per_s: float, latency_s: float):
        self.bytes_per_s = gbytes_per_s * 1e9
        self.latency_s = latency_s
        self.free_at = 0.0

    def ready_time(self, pass_start: float, pass_end: float, nbytes: int) -> float:
        """When K/V of `nbytes` written during [pass_start, pass_end] have all arrived."""
        start = max(pass_start, self.free_at)
        self.free_at = start + nbytes / self.bytes_per_s
        return max(pass_end, self.free_at) + self.latency_s


class _Item:
    __slots__ = ("req", "done", "dropped")

    def __init__(self, req: SimRequest):
        self.req = req
        self.done = 0  # prompt tokens prefilled so far (long prompts)
        self.dropped = False  # its request was preempted: a pass or transfer under way ends for nothing


class PrefillSim:
    def __init__(self, loop: EventLoop, costs: PassCosts, link: Link, *, pass_tokens: int,
                 tokens_per_page: int, kv_bytes_per_token: int, on_ready: Callable[[SimRequest], None]):
        """`on_ready(req)` is called at the time the request's first token and K/V are ready."""
        self.loop = loop
        self.costs = costs
        self.link = link
        self.pass_tokens = pass_tokens
        self.chunk_tokens = chunk_tokens(pass_tokens, tokens_per_page)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.on_ready = on_ready
        self.shorts: list[_Item] = []  # in arrival order
        self.longs: list[_Item] = []  # in arrival order
        self.load_tokens = 0  # prompt tokens queued or in flight (routing)
        self.items: dict[int, _Item] = {}  # request index -> its item, from submit until its K/V are ready
        self.busy = False
        self._pending = False
        self.turn = PassTurn()
        self.passes = 0

    def submit(self, req: SimRequest) -> None:
        item = self.items[req.index] = _Item(req)
        (self.longs if req.prompt_len > self.pass_tokens else self.shorts).append(item)
        self.load_tokens += req.prompt_len
        self._kick()

    def drop(self, req: SimRequest) -> bool:
        """Forget a preempted request (the prefill worker's Abort); False if its K/V were ready already."""
        item = self.items.pop(req.index, None)
        if item is None:
            return False
        item.dropped = True
        self.load_tokens -= req.prompt_len
        self.shorts = [it for it in self.shorts if it is not item]
        self.longs = [it for it in self.longs if it is not item]
        return True

    def _kick(self) -> None:
        if not self.busy and not self._pending:
            self._pending = True
            self.loop.soon(self._start)

    def _start(self) -> None:
        self._pending = False
        if self.busy or not (self.shorts or self.longs):
            return
        take_long = self.turn.take_long(bool(self.longs), bool(self.shorts))
        if take_long:
            it = next_long(self.longs, _priority, lambda it: it.done > 0)
            group, chunks = [it], [(it.done, min(self.chunk_tokens, it.req.prompt_len - it.done))]
        else:
            group = self._pack()
            chunks = [(0, it.req.prompt_len) for it in group]
        now = self.loop.now
        for it in group:
            if math.isnan(it.req.prefill_start):  # its first pass (a resumed request's was before)
                it.req.prefill_start = now
        self.busy = True
        self.passes += 1
        self.loop.at(now + self.costs.prefill_time(chunks), self._end, group, chunks, now)

    def _pack(self) -> list[_Item]:
        """The prompts of a packed pass, removed from the queue."""
        group = pack(in_turn(self.shorts, _priority), lambda it: it.req.prompt_len, self.pass_tokens, _priority)
        taken = set(map(id, group))
        self.shorts = [it for it in self.shorts if id(it) not in taken]
        return group

    def _end(self, group: list[_Item], chunks: list[tuple[int, int]], start: float) -> None:
        now = self.loop.now
        nbytes = sum(n for _, n in chunks) * self.kv_bytes_per_token
        ready = self.link.ready_time(start, now, nbytes)
        for it, (_, n) in zip(group, chunks):
            it.done += n
            if it.done == it.req.prompt_len and not it.dropped:
                if it in self.longs:
                    self.longs.remove(it)
                self.loop.at(ready, self._ready, it)
        self.busy = False
        self._kick()

    def _ready(self, it: _Item) -> None:
        if it.dropped:
            return
        del self.items[it.req.index]
        self.load_tokens -= it.req.prompt_len
        self.on_ready(it.req)


def _priority(it: _Item) -> int:
    return it.req.priority
