"""Owner-only POSIX shared memory that a torch tensor can live in.

We open `/dev/shm/<name>` ourselves instead of using `multiprocessing.shared_memory`, whose resource
tracker (Python < 3.13) unlinks a segment when any process that merely *attached* to it exits.
Segments are created with mode 0600, so only our user can map them, and every name starts with
SHM_PREFIX so leak checks can find ours.

Ownership: a name says which process made it, `tandem-<tag>-<pid>.<start time>-<random>` (the start
time from /proc/<pid>/stat, so a reused pid is not mistaken for the owner). Every start of a stack or
a worker calls `remove_stale_segments`, which removes segments whose owner is gone, and
`remove_orphaned_triton_regions` for Triton's own python-backend regions, whose names say nothing:
those are removed when no live process maps them. Nothing a `kill -9` leaves survives the next start.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time

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
        return cls(owned_name(tag), size, create=True)

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


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owned_name(tag: str) -> str:
    """A fresh segment name that records this process as its owner."""
    return f"{SHM_PREFIX}{tag}-{os.getpid()}.{_start_time(os.getpid())}-{secrets.token_hex(4)}"


def owner_alive(name: str) -> bool:
    """Whether the process that made segment `name` still runs (True for names we cannot read)."""
    parts = name[len(SHM_PREFIX):].split("-")  # <tag>-<pid>.<start>-<random>
    if len(parts) < 3:
        return True
    pid, _, start = parts[1].partition(".")
    if not pid.isdigit():
        return True
    now = _start_time(int(pid))
    return now is not None and (not start or start == now)


def remove_stale_segments() -> list[str]:
    """Unlink our segments whose creating process is gone (a worker that was killed). Returns them."""
    removed = []
    for name in our_segments():
        if not owner_alive(name):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass  # removed concurrently by someone else
    return removed


TRITON_PREFIX = "triton_python_backend"


def _group_of(pid: str) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[2])


def mapped_shm_files(pgid: int | None = None) -> set[str]:
    """Every /dev/shm file a live process maps (that we can see); only process group `pgid`'s if given."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if pgid is not None and _group_of(entry) != pgid:
                continue
            with open(f"/proc/{entry}/maps") as f:
                found.update(line.split(None, 5)[5].strip().replace(" (deleted)", "") for line in f
                             if " /dev/shm/" in line)
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked, or is not ours to read
    return found


def process_started_at(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), or None if there is no such process."""
    ticks = _start_time(pid)
    if ticks is None:
        return None
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    return boot + int(ticks) / os.sysconf("SC_CLK_TCK")


def remove_orphaned_triton_regions(min_age_s: float = 60.0, made_since: float | None = None) -> list[str]:
    """Unlink Triton python-backend regions no process maps, older than `min_age_s` (a region a
    starting server made a moment ago may not be mapped yet).

    `made_since` (epoch seconds): also unlink unmapped regions written at or after it, whatever their
    age: a stopped server's group calls this once it is gone, for the regions it made after its last
    snapshot (a server stopped while loading its models makes them as it goes).
    """
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(TRITON_PREFIX)]
    except FileNotFoundError:
        return []
    if not names:
        return []
    mapped, removed, now = mapped_shm_files(), [], time.time()
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            written = os.stat(path).st_mtime
            ours = made_since is not None and written >= made_since
            if path not in mapped and (ours or now - written > min_age_s):
                os.unlink(path)
                removed.append(name)
        except FileNotFoundError:
            pass  # removed concurrently
    return removed
