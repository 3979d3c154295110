"""Which `tritonserver` Tandem runs, with its backend directory: one choice, in this order.

1. `TANDEM_TRITONSERVER`: the path of a tritonserver executable (its backends are read from
   `<its root>/backends`, as Triton's own layout has them, or from `TANDEM_TRITON_BACKENDS`);
2. NVIDIA's Triton image's own server, `/opt/tritonserver/bin/tritonserver` when present (the GPU
   images, deploy/Dockerfile.gpu), with `/opt/tritonserver/backends`;
3. the server bundled in the `nvidia-pytriton` wheel (CPU machines, the CPU image), with its bundled
   libraries on LD_LIBRARY_PATH and a backend directory holding the python backend stub for this Python.
The python backend's stub runs the `python3` first on PATH (ops/triton_process.py puts ours first), so
the image's stub must match this environment's Python version (the GPU image's venv is made from it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from engine.checkpoint import cache_dir

OVERRIDE = "TANDEM_TRITONSERVER"
IMAGE_ROOT = "/opt/tritonserver"


class TritonError(RuntimeError):
    """The server could not be found, did not start, or did not become ready (with its log tail)."""


@dataclass(frozen=True)
class TritonBinary:
    path: str  # the tritonserver executable
    backends: str  # its --backend-directory
    libs: str | None  # put first on LD_LIBRARY_PATH (the wheel's bundled libraries); None: the system's
    source: str  # where it came from: TANDEM_TRITONSERVER, image, or nvidia-pytriton


def find_triton(env: dict | None = None, image_root: str = IMAGE_ROOT) -> TritonBinary:
    """The server to run (see the module doc); TritonError naming what is missing when there is none."""
    env = os.environ if env is None else env
    override = env.get(OVERRIDE)
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise TritonError(f"{OVERRIDE}={override!r} is not an executable file (unset it to use the image's or "
                              f"the nvidia-pytriton wheel's tritonserver)")
        backends = env.get("TANDEM_TRITON_BACKENDS") or os.path.join(os.path.dirname(os.path.dirname(override)),
                                                                     "backends")
        return TritonBinary(override, backends, None, OVERRIDE)
    image = os.path.join(image_root, "bin", "tritonserver")
    if os.path.isfile(image) and os.access(image, os.X_OK):
        return TritonBinary(image, os.path.join(image_root, "backends"), None, "image")
    root, libs = _pytriton_root()
    return TritonBinary(os.path.join(root, "bin", "tritonserver"), backend_dir(), libs, "nvidia-pytriton")


def _pytriton_root() -> tuple[str, str]:
    spec = importlib.util.find_spec("pytriton")  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise TritonError(f"Triton is not installed: pip install nvidia-pytriton (it ships the tritonserver binary), "
                          f"or run in NVIDIA's Triton image, or set {OVERRIDE}")
    root = os.path.join(list(spec.submodule_search_locations)[0], "tritonserver")
    libs = os.path.join(os.path.dirname(os.path.dirname(root)), "nvidia_pytriton.libs")
    return root, libs


def backend_dir() -> str:
    """A backend directory whose python/ holds the wheel's backend library and the stub for this Python."""
    root, _ = _pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = os.path.join(root, "python_backend_stubs", version, "triton_python_backend_stub")
    if not os.path.isfile(stub):
        raise TritonError(f"nvidia-pytriton has no python backend stub for Python {version}")
    target = os.path.join(cache_dir(), "triton-backends", f"py{version}")
    python = os.path.join(target, "python")
    if not os.path.isfile(os.path.join(python, "triton_python_backend_stub")):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target))
        os.makedirs(os.path.join(tmp, "python"))
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(os.path.join(root, "backends", "python", name), os.path.join(tmp, "python", name))
        shutil.copy2(stub, os.path.join(tmp, "python", "triton_python_backend_stub"))
        if os.path.exists(target):
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    return target
