"""Owner-only POSIX shared memory that a torch tensor can live in.

We open `/dev/shm/<name>` ourselves instead of using `multiprocessing.shared_memory`, whose resource
tracker (Python < 3.13) unlinks a segment when any process that merely *attached* to it exits.
Segments are created with mode 0600, so only our user can map them, and every name starts with
SHM_PREFIX so leak checks can find ours.
"""

from __future__ import annotations

import mmap
import os
import secrets

SHM_DIR = "/dev/shm"
SHM_PREFIX = "tandem-"


class SharedBuffer:
    """A mapped shared-memory segment. The creator owns the name and must call `unlink`."""

    def __init__(self, name: str, size: int, create: bool):
        if "/" in name or not name.startswith(SHM_PREFIX):
            raise ValueError(f"shared memory name must start with {SHM_PREFIX!r} and contain no '/': {name!r}")
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise ValueError(f"shared memory {name} has {actual} bytes, expected {size}")
            self.mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            if create:
                os.unlink(self.path)
            raise
        os.close(fd)
        self.size = size

    @classmethod
    def create(cls, size: int, tag: str = "kv") -> "SharedBuffer":
        return cls(f"{SHM_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(4)}", size, create=True)

    @classmethod
    def attach(cls, name: str, size: int) -> "SharedBuffer":
        return cls(name, size, create=False)

    def tensor(self, dtype, shape: tuple[int, ...]):
        """A torch tensor view of the whole segment; it shares memory with every other process's view."""
        import torch  # here, not at import: the orchestrator uses this module's cleanup without torch

        return torch.frombuffer(self.mmap, dtype=dtype).view(shape)

    def prefault(self) -> None:
        """Touch every OS page once so the first real write does not pay page faults (~3x slower)."""
        import torch

        view = torch.frombuffer(self.mmap, dtype=torch.uint8)
        step = mmap.PAGESIZE
        view[::step] = view[::step]

    def close(self) -> None:
        """Unmap. Tensors made by `tensor` must be gone first; the mapping stays valid until then."""
        try:
            self.mmap.close()
        except BufferError:
            pass  # a tensor still views the mapping; the OS unmaps when it is collected

    def unlink(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def our_segments() -> list[str]:
    """Names of Tandem's segments currently in /dev/shm (for leak checks and `workers down`)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX))
    except FileNotFoundError:
        return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments() -> list[str]:
    """Unlink our segments whose creating process is gone (a worker that was killed). Returns them."""
    removed = []
    for name in our_segments():
        parts = name[len(SHM_PREFIX):].split("-")  # <tag>-<pid>-<random>
        if len(parts) >= 3 and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass  # removed concurrently by someone else
    return removed
