"""The fence for writers that share the pool's memory (shm, inproc): once a decode worker revokes a
lease, no write of that lease's writer can land, whatever the writer does afterwards.

A fence table is a small owner-only shared-memory file beside the KV pool: one 8-byte word per lease
slot holding the epoch of the lease currently allowed to write there (0: nobody). Both sides use Linux
open-file-description (OFD) byte-range locks on the slot's 8 bytes:

- writer, for every layer it writes: take a *read* lock on its slot, check that the word still holds its
  epoch (else LeaseLost: the pages were taken back), copy the layer's pages, drop the lock;
- decode worker, to revoke: set the word to 0 (from then on every check fails), then take the *write*
  lock on the slot and drop it. Once it has had the lock no copy can be in flight: one would hold the
  read lock. (Clearing the word first means a busy writer cannot starve the revoke by taking read
  locks layer after layer: its very next check fails.)

A revoke that finds the slot locked (a copy in flight right now) does not wait on the loop thread:
`revoke` returns False and a helper thread waits for the lock, so that pages of a writer that is stopped
mid-copy (SIGSTOP) stay out of the free list until it resumes or dies. The kernel drops a dead process's
locks, so a killed writer never blocks a revoke. OFD locks (not POSIX process locks) are owned by each
open file, so two writers in one process, or their threads, never release each other's locks.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Callable
from contextlib import contextmanager

import torch

from engine.shm_region import SHM_DIR, SHM_PREFIX, owned_name
from tandem.status import LeaseLost, TransferFailed

WORD = 8
_FLOCK = "hhqqi4x"  # struct flock on Linux x86_64/aarch64: l_type, l_whence, l_start, l_len, l_pid (+pad)


def _lock(fd: int, kind: int, slot: int, wait: bool) -> bool:
    """OFD-lock (or unlock) bytes [slot*8, slot*8+8) of fd. False if `wait` is False and it is taken."""
    arg = struct.pack(_FLOCK, kind, os.SEEK_SET, slot * WORD, WORD, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, arg)
    except (BlockingIOError, PermissionError):
        return False
    return True


class FenceTable:
    """The decode worker's side: arms a slot for a lease, revokes it when the lease ends."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.name = owned_name("fence")
        self.path = os.path.join(SHM_DIR, self.name)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, num_slots * WORD)
        self.words = mmap.mmap(self.fd, num_slots * WORD)
        self._next_epoch = 1

    def arm(self, slot: int) -> int:
        """Allow one new writer into `slot`; returns its epoch (never 0, never reused)."""
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        _lock(self.fd, fcntl.F_WRLCK, slot, wait=True)  # uncontended: the slot was revoked before reuse
        struct.pack_into("<Q", self.words, slot * WORD, epoch)
        _lock(self.fd, fcntl.F_UNLCK, slot, wait=True)
        return epoch

    def revoke(self, slot: int, on_done: Callable[[int], None]) -> bool:
        """Fence the slot's writer out. True: done now. False: a copy is in flight; `on_done(slot)` is
        called from a helper thread once it is done (the caller keeps the pages out of use until then)."""
        if self._clear(slot, wait=False):
            return True
        threading.Thread(target=self._revoke_later, args=(slot, on_done), name=f"fence-{slot}", daemon=True).start()
        return False

    def _revoke_later(self, slot: int, on_done: Callable[[int], None]) -> None:
        self._clear(slot, wait=True)
        on_done(slot)

    def _clear(self, slot: int, wait: bool) -> bool:
        struct.pack_into("<Q", self.words, slot * WORD, 0)  # no new check can pass ...
        if not _lock(self.fd, fcntl.F_WRLCK, slot, wait):  # ... and once we hold the lock, no copy is in flight
            return False
        _lock(self.fd, fcntl.F_UNLCK, slot, wait=True)
        return True

    def close(self) -> None:
        self.words.close()
        os.close(self.fd)
        if os.path.exists(self.path):
            os.unlink(self.path)


class FenceGuard:
    """A writer's side: `with guard.hold(slot, epoch):` around every copy into the lease's pages."""

    def __init__(self, name: str):
        if "/" in name or not name.startswith(SHM_PREFIX):
            raise TransferFailed(f"fence table name must start with {SHM_PREFIX!r} and contain no '/'")
        try:
            self.fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)  # our own open file: our own locks
        except OSError as e:
            raise TransferFailed(f"cannot open fence table {name!r}: {e} (is the decode worker running?)") from None
        self.words = mmap.mmap(self.fd, 0)

    @contextmanager
    def hold(self, slot: int, epoch: int):
        if not 0 <= slot < len(self.words) // WORD:
            raise TransferFailed(f"lease slot {slot} is outside the fence table")
        _lock(self.fd, fcntl.F_RDLCK, slot, wait=True)
        try:
            (current,) = struct.unpack_from("<Q", self.words, slot * WORD)
            if current != epoch:
                raise LeaseLost(f"lease slot {slot} was revoked (epoch {epoch} no longer holds it): the decode "
                                f"worker took its pages back; nothing was written")
            yield
        finally:
            _lock(self.fd, fcntl.F_UNLCK, slot, wait=True)

    def close(self) -> None:
        """Safe to call twice (a second close must not close a descriptor number reused since)."""
        if self.fd < 0:
            return
        self.words.close()
        os.close(self.fd)
        self.fd = -1


class FenceWords:
    """The fence table mapped once more, as a tensor `words`: [slots] int64, for NIXL to register so
    that a remote pull reader can READ its slot's epoch (engine/transports/pull_nixl.py). Never written
    through this mapping."""

    def __init__(self, name: str):
        if "/" in name or not name.startswith(SHM_PREFIX):
            raise TransferFailed(f"fence table name must start with {SHM_PREFIX!r} and contain no '/'")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.words = torch.frombuffer(self.map, dtype=torch.int64)  # [slots]

    def close(self) -> None:
        del self.words  # the tensor holds an export of the map: it must go before the map closes
        self.map.close()
