"""What the device itself can do, measured here: copy bandwidth (the decode roofline) and the dense
matmul rate (the prefill ceiling). Timings use CUDA events on a GPU, the wall clock on CPU."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], device: torch.device, repeat: int, warmup: int = 1) -> float:
    """Mean seconds of `fn` over `repeat` calls after `warmup` calls, device work included."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def copy_bandwidth(device: torch.device, nbytes: int, repeat: int = 20) -> dict:
    """A device-to-device copy of nbytes: GB/s of bytes read plus bytes written (what HBM serves)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    s = seconds_per_call(lambda: dst.copy_(src), device, repeat)
    ok = bool(torch.equal(dst[:4096], src[:4096]))
    return {"bytes": nbytes, "ms": round(s * 1e3, 3), "read_write_gbps": round(2 * nbytes / s / 1e9, 1),
            "copied_correctly": ok}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeat: int = 10) -> dict:
    """TFLOP/s of an n x n x n matmul (2 n^3 flops) in `dtype`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    s = seconds_per_call(lambda: a @ b, device, repeat)
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "ms": round(s * 1e3, 3),
            "tflops": round(2 * n ** 3 / s / 1e12, 3)}


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": str(device)}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2 ** 30, 1),
                "compute_capability": f"{p.major}.{p.minor}", "cuda": torch.version.cuda}
    return env
