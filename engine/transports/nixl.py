"""`nixl`: the handoff through NVIDIA NIXL (UCX backend): one-sided WRITEs plus a completion notification.

The decode pool is registered memory. The prefill worker copies each layer's K/V into a registered
staging area laid out in pages, posts a WRITE of those pages into the reserved remote pages, and goes
on computing; `finish` waits for every WRITE and then notifies the decode worker (`done`); `abort` waits
for what is in flight and sends `closed`. Those notices are this transport's fence (see base.py).
A pool in GPU memory is registered as VRAM (and a prefill worker on a GPU stages in VRAM), so UCX moves
it GPU to GPU (NVLink/RDMA with GPUDirect where present); only DRAM to DRAM has run here (no GPU).
`NixlEndpoint` also exports a prefill worker's pool to pull readers (engine/transports/pull_nixl.py):
with its fence table registered too, so that a reader READs its slot's epoch before the pages.

Settings learned the hard way: UCX backend with `ucx_error_handling_mode: none` (shared-memory-only
transports do not start otherwise); no progress thread (it spins a core), we poll with back-off; UCX on
loopback unless UCX_NET_DEVICES says otherwise (docs/deploy.md); no metadata listener: agent metadata
travels in our descriptor over the control channel; nothing from a peer is unpickled.
"""

from __future__ import annotations

import base64
import os
import secrets
import time

import torch

from engine.kv_pool import TORCH_DTYPES, KVCache
from engine.page_allocator import PageAllocator
from engine.transports.base import (KVSender, LayerWriter, Notices, PoolEndpoint, TransferState, copy_into_pages,
                                    page_runs)
from engine.transports.fence import FenceWords
from engine.transports.nixl_agent import (agent, available, descs, memory_of, notice, parse_notice,  # noqa: F401
                                          unavailable)
from tandem.kv_layout import KVLayout
from tandem.pool import Destination, NixlPool
from tandem.status import TransferFailed

NAME = "nixl"
STAGING_BYTES = 64 << 20  # registered staging for layers in flight; writers wait when it is full
PROGRESS_EVERY_S = 0.002  # while notices may still be on their way out: progress UCX this often ...
PROGRESS_FOR_S = 0.5  # ... for this long after the last one (seen: a notice left within a few ms)


class NixlEndpoint(PoolEndpoint):
    name = NAME
    notifies = True
    strict_fence = False  # one-sided writes: the fence is the writer's close notice

    def __init__(self, cache: KVCache, fence_name: str = "", registry: dict | None = None):
        self.cache = cache
        self.agent_name = f"pool-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = agent(self.agent_name)
        self.reg = self.agent.register_memory(cache.data)
        self.fence = FenceWords(fence_name) if fence_name else None  # pull readers check their epoch there
        self.fence_reg = self.agent.register_memory(self.fence.words) if self.fence else None
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()

    def part(self) -> NixlPool:
        memory, device_id = memory_of(self.cache.data)
        return NixlPool(agent=self.agent_name, metadata=self.metadata, base=self.cache.data.data_ptr(),
                        bytes=self.cache.data.numel() * self.cache.data.element_size(), memory=memory,
                        device_id=device_id, fence_base=self.fence.words.data_ptr() if self.fence else 0)

    def needs_progress(self) -> bool:
        return True  # UCX's TCP transport moves incoming WRITEs only while this side polls too

    def poll(self) -> Notices:
        out = Notices()
        for _peer, messages in self.agent.get_new_notifs().items():
            for m in messages:
                notice = parse_notice(m)
                if notice is None:
                    continue  # not ours, or malformed: nothing to act on
                kind, slot, epoch, rid = notice
                out.closed.add((slot, epoch))
                if kind == "done":
                    out.ready.add(rid)
        return out

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)
        if self.fence is not None:
            self.agent.deregister_memory(self.fence_reg)
            self.fence.close()
        del self.agent


class NixlWriter(LayerWriter):
    def __init__(self, sender: "NixlSender", peer: "_Peer", request_id: str, dest: Destination, layout: KVLayout):
        super().__init__(request_id, dest, layout)
        self.sender, self.peer, self.num_pages = sender, peer, dest.pool.num_pages
        self.inflight: list[tuple[object, list[int]]] = []  # (transfer handle, staging pages it reads)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, runs: list) -> None:
        dest = [first + i for _, first, length in runs for i in range(length)]
        n_pages = len(dest)
        staged = self.sender.stage(self, 2 * n_pages)
        ks, vs = staged[:n_pages], staged[n_pages:]
        self.sender.copy_in(ks, k)
        self.sender.copy_in(vs, v)
        if self.sender.staging.is_cuda:  # the WRITE reads staging outside torch's streams: the copies must be in
            torch.cuda.current_stream(self.sender.staging.device).synchronize()
        remote = [((layer * 2 + kv) * self.num_pages + p) for kv in (0, 1) for p in dest]
        self._post(staged, remote)
        self.bytes_written += 2 * k.numel() * k.element_size()

    def _post(self, staged: list[int], remote_blocks: list[int]) -> None:
        s = self.sender
        try:
            handle = s.agent.make_prepped_xfer("WRITE", s.local_prep, staged, self.peer.prep, remote_blocks, b"")
            if s.agent.transfer(handle) == "ERR":
                raise TransferFailed("NIXL reported ERR")
        except Exception as e:  # nixl raises its own exception types (peer disconnected, not found, ...)
            s.unstage(staged)
            raise TransferFailed(f"request {self.request_id}: NIXL write failed: {e}") from e
        self.inflight.append((handle, staged))

    def wait(self, budget_s: float = 30.0) -> None:
        """Block until every posted WRITE completed (sleeping between checks, never spinning a core);
        on a failed or timed-out WRITE the writer fails (its error is raised by finish)."""
        deadline = time.monotonic() + budget_s
        s = self.sender
        pause = 20e-6
        while self.inflight:
            handle, staged = self.inflight[0]
            try:
                state, err = s.agent.check_xfer_state(handle), None
            except Exception as e:  # the peer died mid-transfer
                state, err = "ERR", e
            if state == "PROC" and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)  # a transfer takes 10 us .. ms: back off to 1 ms checks
                continue
            self.inflight.pop(0)
            s.agent.release_xfer_handle(handle)
            s.unstage(staged)
            if state != "DONE":
                self.release_all()
                self.fail(TransferFailed(f"request {self.request_id}: NIXL transfer {state}: {err or 'timed out'}"))
                return

    def settle(self) -> None:
        self.wait()  # a redone layer must not race a WRITE of the given-up pass to the same pages

    def release_all(self) -> None:
        for handle, staged in self.inflight:
            self.sender.agent.release_xfer_handle(handle)
            self.sender.unstage(staged)
        self.inflight.clear()

    def finish(self) -> None:
        self.wait()
        if self.error is not None:
            self._notify("closed")
            raise self.error
        self._notify("done")
        self.state = TransferState.DONE

    def abort(self) -> None:
        if self.state is TransferState.WRITING:
            self.state = TransferState.ABORTED
        self.wait(budget_s=5.0)  # staging must not be reused, nor the pages freed, while a WRITE is in flight
        self._notify("closed")

    def _notify(self, kind: str) -> None:
        self.sender.keep_progressing()
        try:
            self.sender.agent.send_notif(self.peer.name, notice(kind, self.dest, self.request_id))
        except Exception as e:  # the decode agent is gone: there is nobody left to tell
            self.fail(TransferFailed(f"request {self.request_id}: cannot notify the decode pool: {e}"))


class _Peer:
    """A decode pool we write into: its agent name and a prepared list of all its page blocks."""

    def __init__(self, agent, part: NixlPool, layout: KVLayout, num_pages: int):
        self.name = agent.add_remote_agent(base64.b64decode(part.metadata)).decode()
        blocks = layout.num_layers * 2 * num_pages  # block (layer, k|v, page) = (layer * 2 + kv) * pages + page
        pages = descs(agent, part.base, range(blocks), layout.page_bytes, part.memory, part.device_id)
        self.prep = agent.prep_xfer_dlist(self.name, pages, part.memory)


class NixlSender(KVSender):
    name = NAME

    def __init__(self, layout: KVLayout, registry: dict | None = None, device: str = "cpu"):
        super().__init__(layout)
        self.agent = agent(f"prefill-{os.getpid()}-{secrets.token_hex(4)}")
        pages = max(2, STAGING_BYTES // layout.page_bytes)
        # staging: [pages, tokens_per_page, kv_heads, head_dim], registered once, beside the K/V it stages
        self.staging = torch.zeros(pages, layout.tokens_per_page, layout.num_kv_heads, layout.head_dim,
                                   dtype=TORCH_DTYPES[layout.dtype], device=device)
        self.staging_base = self.staging.data_ptr()
        self.reg = self.agent.register_memory(self.staging)
        memory, device_id = memory_of(self.staging)
        self.local_prep = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(
            self.agent, self.staging_base, range(pages), layout.page_bytes, memory, device_id), memory)
        self.free = PageAllocator(pages)
        self.peers: dict[str, _Peer] = {}  # by the descriptor's agent name
        self.writers: list[NixlWriter] = []
        self._progress_until = 0.0

    def writer(self, dest: Destination, request_id: str) -> NixlWriter:
        part = self.check(dest)
        if part.agent not in self.peers:
            try:
                self.peers[part.agent] = _Peer(self.agent, part, dest.pool.layout, dest.pool.num_pages)
            except Exception as e:  # malformed metadata or an agent NIXL cannot reach
                raise TransferFailed(f"cannot connect to decode pool agent {part.agent!r}: {e}") from None
        w = NixlWriter(self, self.peers[part.agent], request_id, dest, self.layout)
        self.writers = [x for x in self.writers if x.inflight] + [w]
        return w

    def stage(self, writer: NixlWriter, n: int) -> list[int]:
        """n free staging pages; waits for in-flight WRITEs to drain when staging is full."""
        if n > self.free.num_pages:
            raise TransferFailed(f"a layer needs {n} staging pages, staging has {self.free.num_pages}")
        while not self.free.can_allocate(n):
            busy = next((w for w in self.writers if w.inflight), None)
            if busy is None:
                raise TransferFailed("staging exhausted with nothing in flight")
            busy.wait()
        return self.free.allocate(n)

    def unstage(self, pages: list[int]) -> None:
        self.free.free(pages)

    def copy_in(self, pages: list[int], x: torch.Tensor) -> None:
        """x: [tokens, kv_heads, head_dim] -> the given staging pages, in order."""
        copy_into_pages(self.staging, page_runs(pages), x)

    def keep_progressing(self) -> None:
        """A notice was just queued: UCX over TCP sends it only while this agent is progressed."""
        self._progress_until = time.monotonic() + PROGRESS_FOR_S

    def progress_due(self) -> float | None:
        now = time.monotonic()
        return now + PROGRESS_EVERY_S if now < self._progress_until else None

    def progress(self) -> None:
        self.agent.get_new_notifs()  # progresses the UCX worker (nothing is sent to this agent)

    def close(self) -> None:
        for w in self.writers:
            w.release_all()
        for peer in self.peers.values():
            peer.prep.release()
            self.agent.remove_remote_agent(peer.name)
        self.local_prep.release()
        self.agent.deregister_memory(self.reg)
        del self.agent
