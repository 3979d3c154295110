"""A decode worker's pull side (pull handoff): reads each pulling lease's K/V out of its prefill
worker's pool (engine/transports/pull.py: shm, cuda_ipc, NIXL READ) on one thread of its own, so the
running batch keeps stepping while a prompt's pages are copied.

The loop thread submits a lease whose pages are reserved; the read lands in those pages and its outcome
(bytes read, or the error) is queued for the loop, which takes it up at its next iteration. A lease
that ends while its read is in flight keeps its pages until the read returned (`Lease.pulling`): the
reader stops at the next layer once the lease has an end status, and no page is freed under a copy.
A lease that ends before its read started is submitted all the same: the read stops at once, having
read nothing, and the reader still tells the source it is done (a NIXL hold waits for that notice); an
Open refused for want of pages has no lease, and its source is told the same (`say_closed`).
Between reads the same thread progresses readers that ask for it (a NIXL reader's `closed` notice
leaves over UCX's TCP only while its agent is progressed), so every reader is touched by one thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_pool import KVCache
from engine.transports.pull import ONE_HOST, KVReader, reader
from engine.workers.leases import Lease
from tandem.kv_layout import KVLayout
from tandem.pool import PullSource
from tandem.status import TandemError, TransferFailed


@dataclass
class PullResult:
    lease: Lease
    kv_bytes: int
    seconds: float
    error: TandemError | None


class Puller:
    def __init__(self, cache: KVCache, layout: KVLayout, host: str, wake: Callable[[], None],
                 registry: dict | None = None):
        """`wake()`: tell the loop a result is waiting. `registry`: the inproc transport's (tests)."""
        self.cache, self.layout, self.host, self.wake, self.registry = cache, layout, host, wake, registry
        self.readers: dict[str, KVReader] = {}
        self.results: deque[PullResult] = deque()
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()  # (lease, submitted at), (source, None): say closed; None: stop
        self._thread = threading.Thread(target=self._run, name="kv-pull", daemon=True)
        self._thread.start()

    def submit(self, lease: Lease) -> None:
        """Start reading the lease's K/V into its pages (the loop thread; pages already reserved)."""
        lease.pulling = True
        self._jobs.put((lease, time.perf_counter()))

    def say_closed(self, source: PullSource) -> None:
        """An Open refused before its lease existed (no pages): its source hears that nobody here will
        read it (a NIXL hold's pages need not wait for the fence timeout). Any thread."""
        self._jobs.put((source, None))

    def _run(self) -> None:
        """Reads in order; while none waits, progress the readers that are due (see the module doc)."""
        while True:
            due = min((t for r in self.readers.values() if (t := r.progress_due()) is not None), default=None)
            try:
                job = self._jobs.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
            except queue.Empty:
                for r in self.readers.values():
                    if r.progress_due() is not None:
                        r.progress()
                continue
            if job is None:
                return
            if isinstance(job[0], Lease):
                self._read(*job)
            else:
                self._say_closed(job[0])

    def _say_closed(self, source: PullSource) -> None:
        try:
            r = self._reader(source.transport)
        except TandemError:
            return  # no reader of that transport can run here: none read it
        r.say_closed(source)

    def _reader(self, transport: str) -> KVReader:
        """This worker's reader of `transport` (made on first use; TransferFailed if it cannot run here)."""
        if transport not in self.readers:
            self.readers[transport] = reader(transport, self.layout, self.registry)
        return self.readers[transport]

    def _read(self, lease: Lease, t0: float) -> None:
        src, n, error = lease.source, 0, None
        try:
            if src.transport in ONE_HOST and src.pool.host != self.host:
                raise TransferFailed(f"request {lease.request_id}: the prefill worker's pool is on another host; "
                                     f"{src.transport} reads within one host (deploy with transport nixl or auto)")
            n = self._reader(src.transport).read(src, self.cache, lease.pages, lease.cached_tokens,
                                                 stopped=lambda: lease.end_status is not None)
        except TandemError as e:  # LeaseLost (the hold ended), Cancelled (the lease did), TransferFailed
            error = e
        except Exception as e:  # anything else (a device out of memory, a reader's bug) fails this read, not the thread
            error = TransferFailed(f"request {lease.request_id}: reading its KV pages failed: {type(e).__name__}: {e}")
        with self._lock:
            self.results.append(PullResult(lease, n, time.perf_counter() - t0, error))
        self.wake()

    def collect(self) -> list[PullResult]:
        with self._lock:
            out = list(self.results)
            self.results.clear()
        return out

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        for r in self.readers.values():
            r.close()
        self.readers.clear()
