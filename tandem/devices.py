"""Which device a worker runs on: `auto`, `cpu` or `cuda`, resolved once, at start, in the launching process.

`auto` is CUDA when a CUDA device is visible (torch sees one, after CUDA_VISIBLE_DEVICES), else the CPU.
Asking for `cuda` where none is visible is a `DeviceError` whose message is one line naming CUDA, so a
command refuses at once instead of starting workers that fail minutes later inside Triton.

Light on purpose: torch is imported only when the answer depends on it (not for `cpu`, nor on a machine
with no NVIDIA driver at all).
"""

from __future__ import annotations

import glob
import os

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """A device choice cannot be honoured here; the message says what was asked and what to do."""


def _driver_present() -> bool:
    """Cheap pre-check: an NVIDIA kernel driver exposes /proc/driver/nvidia or /dev/nvidia0, 1, ..."""
    return os.path.isdir("/proc/driver/nvidia") or bool(glob.glob("/dev/nvidia[0-9]*"))


def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without a driver, a GPU, or a CUDA build of torch)."""
    if not _driver_present():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _why_no_cuda() -> str:
    if not _driver_present():
        return "no NVIDIA driver or GPU is visible on this machine"
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) is not None:
        return f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} hides every GPU"
    return "torch.cuda.is_available() is False (driver too old for this torch?)"


def resolve_device(choice: str, gpus: list[int] | tuple[int, ...] = ()) -> str:
    """`cpu` or `cuda` for a choice among DEVICE_CHOICES; every index in `gpus` must be a visible GPU."""
    if choice not in DEVICE_CHOICES:
        raise DeviceError(f"unknown device {choice!r}; allowed: {', '.join(DEVICE_CHOICES)}")
    if choice == "cpu":
        if gpus:
            raise DeviceError(f"gpus {list(gpus)} were given for device cpu; give device cuda (or auto) with gpus")
        return "cpu"
    count = cuda_device_count()
    if count == 0:
        if choice == "auto" and not gpus:
            return "cpu"
        raise DeviceError(f"device cuda asked for, but no CUDA device is usable here: {_why_no_cuda()}; "
                          f"use --device cpu (or auto)")
    bad = [g for g in gpus if not 0 <= g < count]
    if bad:
        raise DeviceError(f"GPU indices {bad} do not exist here; this machine shows CUDA devices 0..{count - 1}")
    return "cuda"
