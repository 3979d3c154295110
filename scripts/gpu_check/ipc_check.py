"""KV handoff bandwidth between GPU memory owners: CUDA IPC between two processes (a decode pool
exported as an IPC handle, written by another process), NIXL with GPU memory registered, and a
device-to-device copy inside one process as the reference.

The handle travels to the child process as JSON on its stdin (bytes as base64), never pickled. When
the project's own transport (engine/transports/cuda_ipc.py) is present the report says so; the
bandwidth measured here is that of the CUDA IPC mechanism it is built on.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import subprocess
import sys
import time

import torch

from scripts.gpu_check.device_rates import seconds_per_call

PATTERN_MOD = 251  # bytes written are (index % 251): a shifted or partial copy cannot pass the check


def _pattern(n: int, device) -> torch.Tensor:
    return (torch.arange(n, device=device, dtype=torch.int64) % PATTERN_MOD).to(torch.uint8)


def in_process_copy(device: torch.device, nbytes: int, repeat: int = 20) -> dict:
    src, dst = _pattern(nbytes, device), torch.zeros(nbytes, dtype=torch.uint8, device=device)
    s = seconds_per_call(lambda: dst.copy_(src), device, repeat)
    return {"bytes": nbytes, "gbps": round(nbytes / s / 1e9, 1), "correct": bool(torch.equal(src, dst))}


def _encode(handle: tuple) -> list:
    return [{"b64": base64.b64encode(x).decode()} if isinstance(x, bytes) else x for x in handle]


def _decode(fields: list) -> tuple:
    return tuple(base64.b64decode(x["b64"]) if isinstance(x, dict) else x for x in fields)


def two_process_copy(device: torch.device, nbytes: int, repeat: int = 20, timeout_s: float = 120.0) -> dict:
    """The parent exports a buffer; a child process maps it and writes it `repeat` times."""
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    handle = dst.untyped_storage()._share_cuda_()  # (device, handle, size, offset, refcounter, ..., event, ...)
    request = json.dumps({"handle": _encode(handle), "bytes": nbytes, "repeat": repeat})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check.ipc_check"], input=request, text=True,
                          capture_output=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"IPC child failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    torch.cuda.synchronize(device)
    correct = bool(torch.equal(dst, _pattern(nbytes, device)))
    return {"bytes": nbytes, "gbps": child["gbps"], "correct": correct,
            "child_wall_s": round(time.perf_counter() - t0, 2),
            "project_transport": importlib.util.find_spec("engine.transports.cuda_ipc") is not None}


def _child() -> None:
    """Map the parent's buffer from the handle on stdin, write the pattern into it, print GB/s."""
    req = json.loads(sys.stdin.read())
    storage = torch.UntypedStorage._new_shared_cuda(*_decode(req["handle"]))
    n = req["bytes"]
    device = storage.device
    dst = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (n,), (1,))
    src = _pattern(n, device)
    s = seconds_per_call(lambda: dst.copy_(src), device, req["repeat"])
    torch.cuda.synchronize(device)
    print(json.dumps({"gbps": round(n / s / 1e9, 1)}))


def nixl_vram(device: torch.device, nbytes: int, repeat: int = 10) -> dict:
    """Two NIXL agents in this process, both buffers registered as GPU memory: WRITE GB/s."""
    from engine.transports.nixl_agent import agent

    a, b = agent("gpu-check-a"), agent("gpu-check-b")
    src, dst = _pattern(nbytes, device), torch.zeros(nbytes, dtype=torch.uint8, device=device)
    ra, rb = a.register_memory(src), b.register_memory(dst)
    try:
        remote = a.add_remote_agent(b.get_agent_metadata())
        local_descs, remote_descs = a.get_xfer_descs([src]), b.get_xfer_descs([dst])

        def write():
            h = a.initialize_xfer("WRITE", local_descs, remote_descs, remote, b"")
            if a.transfer(h) == "ERR":
                raise RuntimeError("NIXL reported ERR")
            while (state := a.check_xfer_state(h)) == "PROC":
                pass
            a.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended {state}")

        write()
        t0 = time.perf_counter()
        for _ in range(repeat):
            write()
        s = (time.perf_counter() - t0) / repeat
        torch.cuda.synchronize(device)
        return {"bytes": nbytes, "gbps": round(nbytes / s / 1e9, 1), "correct": bool(torch.equal(src, dst))}
    finally:
        a.deregister_memory(ra)
        b.deregister_memory(rb)


def nixl_available() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12"))


if __name__ == "__main__":
    _child()
