"""llama.cpp as a reference for scripts/bench_engine.py: the same weights, the same precision, one run.

llama-cpp-python is never a project dependency. The benchmark builds it once for this CPU into a cache
folder (3 minutes to an hour on 2 cores; the package index must be reachable) and reuses it afterwards:

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install --no-deps --target ~/.cache/tandem-bench/llama-cpp llama-cpp-python
    pip install --no-deps --target ~/.cache/tandem-bench/llama-cpp diskcache

(`-DLLAVA_BUILD=OFF` skips the multimodal library, which the benchmark does not need; `--no-deps` keeps a
second numpy out of the folder: the rest of what llama_cpp imports is in the project's environment.)

The packaged SmolLM2 GGUF is Q4_1; the engine dequantizes it on load. So that llama.cpp reads the same
numbers at the same precision, `same_gguf` writes a copy of that GGUF with every tensor dequantized and
stored as F32 (or BF16 for the weight matrices, norms staying F32 as llama.cpp's own converter does),
names, layout and metadata unchanged.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time

import numpy as np

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tandem-bench")
LLAMA_CPP_DIR = os.path.join(CACHE, "llama-cpp")
GGML_TYPES = {"float32": "F32", "bfloat16": "BF16"}


def load_llama_cpp():
    """The llama_cpp module from the cache folder, built there first when absent; None (with the reason
    printed) when it can be neither imported nor built."""
    if LLAMA_CPP_DIR not in sys.path:  # last: nothing in it may shadow the venv's packages
        sys.path.append(LLAMA_CPP_DIR)
    try:
        import llama_cpp
    except ImportError:
        if not _build():
            return None
        import llama_cpp
    return llama_cpp


def _build() -> bool:
    """pip-installs llama-cpp-python, compiled for this CPU, into LLAMA_CPP_DIR; True when it imports after."""
    print(f"llama.cpp: building llama-cpp-python into {LLAMA_CPP_DIR} (once; minutes to an hour)", flush=True)
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF",
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", LLAMA_CPP_DIR]
    for package in ("llama-cpp-python", "diskcache"):
        done = subprocess.run(pip + [package], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            print(f"llama.cpp skipped: installing {package} failed ({' / '.join(tail)})")
            return False
    sys.path_importer_cache.pop(LLAMA_CPP_DIR, None)  # the folder did not exist when first looked in
    importlib.invalidate_caches()
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        print(f"llama.cpp skipped: llama-cpp-python was built in {LLAMA_CPP_DIR} but does not import ({e})")
        return False
    return True


def same_gguf(src: str, dtype: str) -> str:
    """A copy of the GGUF `src` dequantized to `dtype` (float32 | bfloat16), written once into the cache."""
    import gguf

    ggml = GGML_TYPES[dtype]
    out = os.path.join(CACHE, "gguf", os.path.basename(src).removesuffix(".gguf") + f".{ggml}.gguf")
    if os.path.isfile(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out + ".part", arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    bf16 = dtype == "bfloat16"
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # [*reversed GGUF shape]
        if bf16 and data.ndim == 2:
            bf16_type = gguf.GGMLQuantizationType.BF16
            writer.add_tensor(t.name, gguf.quants.quantize(data, bf16_type), raw_dtype=bf16_type)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(out + ".part", out)
    return out


class LlamaCpp:
    """Batch-1 decode and prompt processing through llama-cpp-python's eval (logits of the last token)."""

    def __init__(self, llama_cpp, path: str, threads: int, n_ctx: int):
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)

    def decode(self, prompt: list[int], new_tokens: int) -> float:
        """tokens/s over `new_tokens - 1` single-token evals after the prompt (greedy, as ours)."""
        self.llm.reset()
        self.llm.eval(prompt)
        t = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([self.greedy()])
        return (new_tokens - 1) / (time.perf_counter() - t)

    def greedy(self) -> int:
        """The argmax of the last evaluated token's logits (eval keeps them in the context only)."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))  # [V]
        return int(np.argmax(logits))

    def prefill(self, prompt: list[int]) -> float:
        """Prompt tokens/s of one eval of the whole prompt from an empty cache."""
        self.llm.reset()  # eval drops cached positions from n_tokens (now 0) on
        t = time.perf_counter()
        self.llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - t)
