"""A request's lease on a decode (or co-located) worker: its pages, its fence slot, its state.

    Open ──▶ RESERVED ──Start──▶ WAITING_KV ──pages ready, room──▶ RUNNING ──stop/length──▶ freed
     ├─(local prefill)──▶ PREFILLING ─────────────────────────────▶ RUNNING
     └─(pull: Open carries a PullSource)──▶ PULLING ──read, Pulled──▶ WAITING_KV (pages ready)
    any state ──Release / cancel / error──▶ ended; pages freed at once if no writer can still write
                                            them, else FENCING ──writer fenced out──▶ freed

A lease is handed to a writer (a prefill worker) from the moment its Reserved reply leaves until the
writer is known to be done: the prefill answered (Start arrived, or the orchestrator says
`writer_closed`), the transport's fence revoked it (shm, inproc), or the writer's close notice
arrived (NIXL). Only then may its pages go back to the free list.

A pulling lease is never handed out: this worker writes its pages itself, reading them from the
prefill worker's pool (engine/workers/puller.py); its pages go back only once that read returned.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.sequence import Sequence
from engine.workers.sink import Responder
from tandem.pool import PullSource


class LeaseState(str, enum.Enum):
    RESERVED = "reserved"  # pages leased to a writer; waiting for Start
    WAITING_KV = "waiting_kv"  # first token in; waiting for the pages' arrival notice or batch room
    PREFILLING = "prefilling"  # this worker computes the prompt
    PULLING = "pulling"  # pull handoff: this worker reads the prompt's K/V from the prefill worker's pool
    RUNNING = "running"
    FENCING = "fencing"  # ended, but a writer may still write its pages: they stay out of use


@dataclass
class Lease:
    request_id: str
    token: str  # shown by Start/Release: only the party that opened the lease can use it
    seq: Sequence
    pages: list[int]
    sink: Responder
    state: LeaseState
    transport: str = ""  # "" for a local prefill (no writer)
    slot: int = -1
    epoch: int = 0
    writer: str = ""  # the prefill worker it was handed to (for WriterGone)
    scheduled: bool = False  # handed to the scheduler
    pages_ready: bool = False
    writer_done: bool = False  # no writer can write these pages any more
    cached_tokens: int = 0  # leading prompt tokens its pages took from the prefix cache (never written)
    end_status: BaseException | None = None  # why it ends (set by release, cancel, timeout)
    source: PullSource | None = None  # pull: where its K/V are held
    pulling: bool = False  # a read into its pages is in flight: they are not freed before it returns
    traceparent: str = ""  # the orchestrator's attempt span (Open.traceparent); "" when not traced
    decoding_since: float = 0.0  # perf_counter when it was handed to the scheduler (its decode span's start)

    @property
    def handed_out(self) -> bool:
        return self.transport != ""

    def needs_fence(self) -> bool:
        """Whether ending the lease now must wait for its writer to be fenced out."""
        return self.handed_out and not self.writer_done
