"""The pull handoff's NIXL READ side: a decode worker reads held K/V out of a prefill worker's pool
wherever UCX reaches it (another host, or this one), one-sided.

The prefill worker registers its pool and its fence table with a NIXL agent (engine/transports/nixl.py,
`NixlEndpoint`) and puts the agent's metadata, the pool's address and the fence table's address in the
PullSource (tandem/pool.py, NixlPool). This side has an agent of its own with the decode pool
registered. A read:
1. READs the source's 8-byte fence word (its slot of the fence table) and compares it with the epoch:
   a hold that already ended fails LeaseLost here, having read no page;
2. READs every page it lacks, all layers, K and V, straight into the pages it reserved, in one
   transfer, and waits for it to complete (a bounded wait: `READ_BUDGET_S`);
3. however the read ended (stopped or refused before any READ too), sends the pool a `closed` notice
   for (slot, epoch): from then on nothing of this reader is in flight. Over UCX's TCP a notice leaves only while the
   agent is progressed: the caller keeps calling `progress` while `progress_due` says so (puller.py).

The fence, the other way round and bounded. A one-sided READ cannot be checked on the prefill side, and
step 1 and step 2 are not atomic: the hold may end between them. So the prefill worker reuses the pages
of a NIXL hold only once no reader can still read them (engine/workers/holds.py): the orchestrator
said so (Unhold after Pulled: the read ended before Pulled was sent), the reader's `closed` notice
arrived, or the fence timeout passed without either (a reader neither heard from nor done within it is
presumed gone: the one bounded assumption, as for push's NIXL writers). A late reader therefore either
fails at step 1 or reads pages still held for its request; it never reads pages another request owns.

A READ that does not complete within the budget is released (NIXL cancels it) and the read fails, as
push's NIXL writer does; only DRAM to DRAM has run here (no GPU).
"""

from __future__ import annotations

import base64
import os
import secrets
import time
from collections.abc import Callable

import torch

from engine.kv_pool import KVCache
from engine.transports.nixl import PROGRESS_EVERY_S, PROGRESS_FOR_S
from engine.transports.nixl_agent import agent, descs, memory_of, notice
from engine.transports.pull import KVReader
from tandem.kv_layout import KVLayout
from tandem.pool import NixlPool, PullSource
from tandem.status import Cancelled, LeaseLost, TransferFailed

READ_BUDGET_S = 30.0  # a READ that has not completed by then is given up (released: NIXL cancels it)


class _Source:
    """A prefill pool we read from: its agent, a prepared list of its page blocks and of its fence words."""

    def __init__(self, agent_, part: NixlPool, layout: KVLayout, num_pages: int, num_slots: int):
        self.name = agent_.add_remote_agent(base64.b64decode(part.metadata)).decode()
        blocks = layout.num_layers * 2 * num_pages  # block (layer, k|v, page) = (layer * 2 + kv) * pages + page
        self.pages = agent_.prep_xfer_dlist(self.name, descs(agent_, part.base, range(blocks), layout.page_bytes,
                                                             part.memory, part.device_id), part.memory)
        self.fence = agent_.prep_xfer_dlist(self.name, descs(agent_, part.fence_base, range(num_slots), 8), "DRAM")

    def release(self, agent_) -> None:
        self.pages.release()
        self.fence.release()
        agent_.remove_remote_agent(self.name)


class _Local:
    """The decode pool, registered with our agent, and a prepared list of its page blocks."""

    def __init__(self, agent_, cache: KVCache):
        memory, device_id = memory_of(cache.data)
        self.data = cache.data
        self.reg = agent_.register_memory(cache.data)
        blocks = cache.layout.num_layers * 2 * cache.num_pages
        self.pages = agent_.prep_xfer_dlist("NIXL_INIT_AGENT", descs(
            agent_, cache.data.data_ptr(), range(blocks), cache.layout.page_bytes, memory, device_id), memory)


class NixlReader(KVReader):
    name = "nixl"

    def __init__(self, layout: KVLayout):
        super().__init__(layout)
        self.agent = agent(f"reader-{os.getpid()}-{secrets.token_hex(4)}")
        self.word = torch.zeros(1, dtype=torch.int64)  # [1]: where a source's fence word is read to
        self.word_reg = self.agent.register_memory(self.word)
        self.word_prep = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(self.agent, self.word.data_ptr(), [0], 8),
                                                    "DRAM")
        self.sources: dict[str, _Source] = {}  # by the source's agent name
        self.locals: dict[int, _Local] = {}  # by the decode pool's address
        self._progress_until = 0.0

    def _source(self, source: PullSource) -> _Source:
        part = self.check(source)
        if not part.fence_base:
            raise TransferFailed(f"request {source.request_id}: the source pool exports no fence table to NIXL "
                                 f"readers (a pool for push only)")
        if part.agent not in self.sources:
            try:
                self.sources[part.agent] = _Source(self.agent, part, source.pool.layout, source.pool.num_pages,
                                                   source.pool.num_slots)
            except Exception as e:  # malformed metadata or an agent NIXL cannot reach
                raise TransferFailed(f"cannot connect to prefill pool agent {part.agent!r}: {e}") from None
        return self.sources[part.agent]

    def _local(self, cache: KVCache) -> _Local:
        key = cache.data.data_ptr()
        if key not in self.locals:
            self.locals[key] = _Local(self.agent, cache)
        return self.locals[key]

    def _copy(self, source: PullSource, cache: KVCache, src_pages: list[int], dst_pages: list[int],
              stopped: Callable[[], bool]) -> None:
        if not 0 <= source.slot < source.pool.num_slots:
            raise TransferFailed(f"request {source.request_id}: fence slot {source.slot} is outside the source's "
                                 f"{source.pool.num_slots} slots")
        src, local = self._source(source), self._local(cache)
        if stopped():
            raise Cancelled(f"request {source.request_id}: the read was stopped")
        self.word.zero_()
        self._transfer(source, self.word_prep, [0], src.fence, [source.slot])
        if int(self.word[0]) != source.epoch:
            raise LeaseLost(f"request {source.request_id}: the hold on the source pages ended (fence slot "
                            f"{source.slot} no longer holds epoch {source.epoch}); nothing was read")
        n_src, n_dst = source.pool.num_pages, cache.num_pages
        blocks = [layer * 2 + kv for layer in range(self.layout.num_layers) for kv in (0, 1)]
        remote = [b * n_src + p for b in blocks for p in src_pages]
        mine = [b * n_dst + p for b in blocks for p in dst_pages]
        self._transfer(source, local.pages, mine, src.pages, remote)

    def read(self, source: PullSource, cache: KVCache, page_ids: list[int], start: int = 0,
             stopped: Callable[[], bool] = lambda: False) -> int:
        """KVReader.read, then the source's `closed` notice however the read ended: one stopped or
        refused before any READ too, so a hold whose reader read nothing comes back at once."""
        try:
            return super().read(source, cache, page_ids, start, stopped)
        finally:
            self.say_closed(source)

    def say_closed(self, source: PullSource) -> None:
        """The `closed` notice for (slot, epoch), to the source pool's agent."""
        try:
            self.agent.send_notif(self._source(source).name, notice("closed", source, source.request_id))
            self._progress_until = time.monotonic() + PROGRESS_FOR_S  # over TCP it leaves only so
        except Exception:  # noqa: BLE001 a source gone or unreachable: nobody is left to tell
            pass

    def progress_due(self) -> float | None:
        now = time.monotonic()
        return now + PROGRESS_EVERY_S if now < self._progress_until else None

    def progress(self) -> None:
        self.agent.get_new_notifs()  # progresses the UCX worker: queued notices leave

    def _transfer(self, source: PullSource, local_prep, local_ids: list[int], remote_prep, remote_ids: list[int]):
        """One READ of remote blocks into local blocks; returns once it completed; TransferFailed if not."""
        try:
            handle = self.agent.make_prepped_xfer("READ", local_prep, local_ids, remote_prep, remote_ids, b"")
        except Exception as e:  # nixl's own exception types (peer gone, bad descriptors)
            raise TransferFailed(f"request {source.request_id}: NIXL read failed: {e}") from e
        deadline, pause, err = time.monotonic() + READ_BUDGET_S, 20e-6, None
        try:
            state = self.agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)  # a READ takes 10 us .. ms: back off to 1 ms checks
                state = self.agent.check_xfer_state(handle)
        except Exception as e:  # the peer died mid-transfer
            state, err = "ERR", e
        finally:
            self.agent.release_xfer_handle(handle)  # one still in flight is cancelled
        if state != "DONE":
            raise TransferFailed(f"request {source.request_id}: NIXL read {state}: {err or 'timed out'}")

    def close(self) -> None:
        for s in self.sources.values():
            s.release(self.agent)
        self.sources.clear()
        for loc in self.locals.values():
            loc.pages.release()
            self.agent.deregister_memory(loc.reg)
        self.locals.clear()
        self.word_prep.release()
        self.agent.deregister_memory(self.word_reg)
        del self.agent
