"""Building and loading Tandem's CPU kernels (the C++ files beside this one; contracts in kernels.h).

The sources are compiled with PyTorch's extension builder (needs a C++ compiler; ninja comes with
Tandem's dependencies) for the CPU's instruction set (`isa`: AVX-512, else AVX2 with FMA; simd16.h) into
`<TANDEM_CACHE or ~/.cache/tandem>/kernels/cpu-<isa>-<digest>/`, one folder per source, instruction set,
PyTorch and Python version, renamed into place only when complete; later processes import the built module
from there without a compiler. `scripts/setup` builds it (`python -m engine.cpu_kernels.build` builds it
and says whether it is in use). Where it cannot be built or the CPU has neither instruction set, `load()`
returns None and the engine keeps PyTorch's kernels; `TANDEM_CPU_KERNELS=off` turns them off (for
side-by-side measurements).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from engine.checkpoint import cache_dir

log = logging.getLogger(__name__)
NAME = "tandem_cpu_kernels"
HERE = Path(__file__).parent
_LOCK = threading.Lock()  # one attempt per process, whichever thread asks first
_LOADED: list = []  # [the module, or None] once tried
# The module's instruction sets, best first: the CPU flags each needs, and the compiler flags of its build.
ISAS = {"avx512": ({"avx512f"}, []), "avx2": ({"avx2", "fma"}, ["-DTANDEM_AVX2"])}
SOURCES = [HERE / n for n in ("module.cpp", "gemv.cpp", "decode_attention.cpp", "rms_norm.cpp",
                             "decode_layers.cpp")]


@functools.cache
def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), e.g. 'avx512f', 'avx512_bf16'; empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def isa() -> str | None:
    """The instruction set the kernels are built for on this CPU ("avx512", "avx2"), or None where the CPU
    has neither (then the engine keeps PyTorch's kernels)."""
    return next((name for name, (needs, _) in ISAS.items() if needs <= cpu_flags()), None)


def _build_dir(target: str) -> Path:
    key = b"".join(p.read_bytes() for p in [*SOURCES, *sorted(HERE.glob("*.h"))])
    key += f"{torch.__version__} {sys.version_info[:2]}".encode()
    return Path(cache_dir()) / "kernels" / f"cpu-{target}-{hashlib.sha256(key).hexdigest()[:16]}"


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(final: Path, target: str):
    """Compile for `target` (an ISAS name) into a private folder, then rename it to `final` (a concurrent
    build that finished first wins; both compiled the same source)."""
    from torch.utils.cpp_extension import load as compile_extension
    tmp = final.with_name(f"{final.name}.building-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        # -fopenmp: at::parallel_for then runs on PyTorch's own OpenMP threads (without it, on one thread);
        # -ffp-contract=off: a product and a sum round separately, as PyTorch's separate ops round them
        flags = ["-O3", "-fopenmp", "-ffp-contract=off", *ISAS[target][1]]
        module = compile_extension(f"{NAME}_{target}", [str(p) for p in SOURCES], build_directory=str(tmp),
                                   extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
        try:
            tmp.rename(final)
        except OSError:
            pass
        return module
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load():
    """The compiled module (functions of kernels.h) for this CPU's `isa`, or None where it is off,
    unbuildable or the CPU has no instruction set it is built for.

    Compiles on first use if the cache lacks this version (~40 s to 2 min on 2 cores). Never raises: a failed
    build is logged once and the engine goes on with PyTorch's kernels.
    """
    if not _LOADED:
        with _LOCK:
            if not _LOADED:
                _LOADED.append(_load())
    return _LOADED[0]


def _load():
    if os.environ.get("TANDEM_CPU_KERNELS", "on").lower() in ("0", "off", "false", "no"):
        return None
    target = isa()
    if target is None:
        return None
    final = _build_dir(target)
    try:
        built = final / f"{NAME}_{target}.so"
        return _import(built) if built.exists() else _build(final, target)
    except Exception as e:  # noqa: BLE001 - any build or import failure means: run without the kernel
        log.warning("Tandem's CPU kernels unavailable, using PyTorch's: %s", (str(e).strip().splitlines() or [repr(e)])[-1])
        return None


def build_all() -> None:
    """Build the module for every instruction set not yet in the cache, whatever this CPU runs: an image
    built on one CPU then runs the kernels on another (deploy/Dockerfile.cpu). Raises if a build fails."""
    for target in ISAS:
        final = _build_dir(target)
        if not (final / f"{NAME}_{target}.so").exists():
            _build(final, target)  # imports it too: safe on any x86-64 CPU (simd16.h)


def main() -> None:
    """Build the kernels (if needed; with --all, for every instruction set) and say whether the engine
    will use them."""
    from engine.cpu_kernels import attention, gemv, layers, norm
    if "--all" in sys.argv[1:]:
        build_all()
    print(f"CPU kernels ({isa()}): {'; '.join(m.describe() for m in (gemv, attention, norm, layers))}" if load()
          else "CPU kernels: not in use (CPU without AVX-512 or AVX2, no C++ compiler, or TANDEM_CPU_KERNELS=off)")


if __name__ == "__main__":
    main()
