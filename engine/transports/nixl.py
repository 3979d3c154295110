"""`nixl`: the handoff through NVIDIA NIXL (UCX backend): one-sided WRITEs plus a completion notification.

The decode pool is registered memory. The prefill worker copies each layer's K/V into a registered
staging area laid out in pages, posts a WRITE of those pages into the reserved remote pages, and goes
on computing; `finish` waits for every WRITE and then notifies the decode worker with the request id.
The same code moves DRAM to DRAM here and VRAM to VRAM over NVLink/RDMA on GPU nodes.

Settings learned the hard way: UCX backend with `ucx_error_handling_mode: none` (shared-memory-only
transports do not start otherwise); no progress thread (it spins a core), we poll; UCX on loopback
only; no metadata listener: agent metadata travels in our descriptor over the control channel, and
nothing from a peer is ever unpickled (no get_serialized_descs).
"""

from __future__ import annotations

import base64
import os
import secrets
import time

import numpy as np
import torch

from engine.kv_pool import TORCH_DTYPES, KVCache, PageAllocator
from engine.transports.base import (KVSender, LayerWriter, PoolEndpoint, TransferError, TransferState,
                                    copy_into_pages, page_runs)
from tandem.kv_layout import KVLayout

NAME = "nixl"
STAGING_BYTES = 64 << 20  # registered staging for layers in flight; writers wait when it is full


def _agent(name: str):
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError:
            raise TransferError("the nixl transport needs NIXL: pip install --no-deps nixl-cu12") from None
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def available() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12"))


def _descs(agent, base: int, block_ids, block_bytes: int):
    ids = np.asarray(block_ids, dtype=np.uint64)
    rows = np.stack([base + ids * np.uint64(block_bytes), np.full(len(ids), block_bytes, np.uint64),
                     np.zeros(len(ids), np.uint64)], axis=1)  # (address, length, device id)
    return agent.get_xfer_descs(rows, "DRAM")


class NixlEndpoint(PoolEndpoint):
    notifies = True

    def __init__(self, cache: KVCache):
        if cache.device.type != "cpu":
            raise ValueError("this build registers host (DRAM) pools; GPU pools need VRAM registration")
        self.cache = cache
        self.agent_name = f"decode-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = _agent(self.agent_name)
        self.reg = self.agent.register_memory(cache.data)
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()

    def descriptor(self) -> dict:
        return {"transport": NAME, "agent": self.agent_name, "metadata": self.metadata,
                "base": self.cache.data.data_ptr(), "bytes": self.cache.data.numel() * self.cache.data.element_size(),
                "num_pages": self.cache.num_pages, "layout": self.cache.layout.to_dict()}

    def poll(self) -> set[str]:
        done = set()
        for _peer, messages in self.agent.get_new_notifs().items():
            for m in messages:
                done.add(m.decode("utf-8", "replace"))  # a request id; unknown ids are ignored by the caller
        return done

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)
        del self.agent


class NixlWriter(LayerWriter):
    def __init__(self, sender: "NixlSender", peer: "_Peer", request_id: str, page_ids: list[int],
                 layout: KVLayout, num_pages: int):
        super().__init__(request_id, page_ids, layout, num_pages)
        self.sender, self.peer, self.num_pages = sender, peer, num_pages
        self.inflight: list[tuple[object, list[int]]] = []  # (transfer handle, staging pages it reads)

    def write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        if self.state is not TransferState.WRITING:
            raise TransferError(f"request {self.request_id}: writer is {self.state.value}")
        dest = self._pages(k.shape[0], start)
        n_pages = len(dest)
        staged = self.sender.stage(self, 2 * n_pages)
        ks, vs = staged[:n_pages], staged[n_pages:]
        self.sender.copy_in(ks, k)
        self.sender.copy_in(vs, v)
        remote = [((layer * 2 + kv) * self.num_pages + p) for kv in (0, 1) for p in dest]
        self._post(staged, remote)
        self.bytes_written += 2 * k.numel() * k.element_size()

    def _post(self, staged: list[int], remote_blocks: list[int]) -> None:
        s = self.sender
        try:
            handle = s.agent.make_prepped_xfer("WRITE", s.local_prep, staged, self.peer.prep, remote_blocks, b"")
            if s.agent.transfer(handle) == "ERR":
                raise TransferError("NIXL reported ERR")
        except Exception as e:  # nixl raises its own exception types (peer disconnected, not found, ...)
            s.unstage(staged)
            self.state = TransferState.FAILED
            raise TransferError(f"request {self.request_id}: NIXL write failed: {e}") from e
        self.inflight.append((handle, staged))

    def wait(self, budget_s: float = 30.0) -> None:
        """Block until every posted WRITE completed; raises TransferError (state FAILED) otherwise."""
        deadline = time.monotonic() + budget_s
        s = self.sender
        while self.inflight:
            handle, staged = self.inflight[0]
            try:
                state = s.agent.check_xfer_state(handle)
            except Exception as e:  # the peer died mid-transfer
                state, err = "ERR", e
            else:
                err = None
            if state == "PROC" and time.monotonic() < deadline:
                continue
            self.inflight.pop(0)
            s.agent.release_xfer_handle(handle)
            s.unstage(staged)
            if state != "DONE":
                self.state = TransferState.FAILED
                self.release_all()
                raise TransferError(f"request {self.request_id}: NIXL transfer {state}: {err or 'timed out'}")

    def release_all(self) -> None:
        for handle, staged in self.inflight:
            self.sender.agent.release_xfer_handle(handle)
            self.sender.unstage(staged)
        self.inflight.clear()

    def finish(self) -> None:
        self.wait()
        if self.state is TransferState.WRITING:
            self.sender.agent.send_notif(self.peer.name, self.request_id.encode())
            self.state = TransferState.DONE

    def abort(self) -> None:
        self.state = TransferState.ABORTED
        try:
            self.wait(budget_s=5.0)  # staging must not be reused while a WRITE still reads it
        except TransferError:
            pass  # aborting anyway; the failure is already recorded in the state
        self.state = TransferState.ABORTED


class _Peer:
    """A decode pool we write into: its agent name and a prepared list of all its page blocks."""

    def __init__(self, agent, pool: dict, layout: KVLayout, num_pages: int):
        self.name = agent.add_remote_agent(base64.b64decode(pool["metadata"])).decode()
        blocks = layout.num_layers * 2 * num_pages  # block (layer, k|v, page) = (layer * 2 + kv) * pages + page
        self.prep = agent.prep_xfer_dlist(self.name, _descs(agent, int(pool["base"]), range(blocks), layout.page_bytes),
                                          "DRAM")


class NixlSender(KVSender):
    def __init__(self, layout: KVLayout):
        super().__init__(layout)
        self.agent = _agent(f"prefill-{os.getpid()}-{secrets.token_hex(4)}")
        pages = max(2, STAGING_BYTES // layout.page_bytes)
        # staging: [pages, tokens_per_page, kv_heads, head_dim], registered once
        self.staging = torch.zeros(pages, layout.tokens_per_page, layout.num_kv_heads, layout.head_dim,
                                   dtype=TORCH_DTYPES[layout.dtype])
        self.staging_base = self.staging.data_ptr()
        self.reg = self.agent.register_memory(self.staging)
        self.local_prep = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(self.agent, self.staging_base, range(pages), layout.page_bytes), "DRAM")
        self.free = PageAllocator(pages)
        self.peers: dict[str, _Peer] = {}  # by the descriptor's agent name
        self.writers: list[NixlWriter] = []

    def writer(self, pool: dict, request_id: str, page_ids: list[int]) -> NixlWriter:
        layout, num_pages = self.check_descriptor(pool, NAME)
        name = pool.get("agent")
        if name not in self.peers:
            try:
                self.peers[name] = _Peer(self.agent, pool, layout, num_pages)
            except Exception as e:  # malformed metadata or an agent NIXL cannot reach
                raise TransferError(f"cannot connect to decode pool agent {name!r}: {e}") from None
        w = NixlWriter(self, self.peers[name], request_id, page_ids, layout, num_pages)
        self.writers = [x for x in self.writers if x.inflight] + [w]
        return w

    def stage(self, writer: NixlWriter, n: int) -> list[int]:
        """n free staging pages; waits for in-flight WRITEs to drain when staging is full."""
        if n > self.free.num_pages:
            raise TransferError(f"a layer needs {n} staging pages, staging has {self.free.num_pages}")
        while not self.free.can_allocate(n):
            busy = next((w for w in self.writers if w.inflight), None)
            if busy is None:
                raise TransferError("staging exhausted with nothing in flight")
            busy.wait()
        return self.free.allocate(n)

    def unstage(self, pages: list[int]) -> None:
        self.free.free(pages)

    def copy_in(self, pages: list[int], x: torch.Tensor) -> None:
        """x: [tokens, kv_heads, head_dim] -> the given staging pages, in order."""
        copy_into_pages(self.staging, page_runs(pages), x)

    def close(self) -> None:
        for w in self.writers:
            w.release_all()
        for peer in self.peers.values():
            peer.prep.release()
            self.agent.remove_remote_agent(peer.name)
        self.local_prep.release()
        self.agent.deregister_memory(self.reg)
        del self.agent
