"""`tandem repo`: render the Triton model repository for a pair of role engines.

    DIR/prefill/config.pbtxt + 1/model.py    dynamic batching, the prefill engine
    DIR/decode/config.pbtxt  + 1/model.py    decoupled, the decode engine and its KV pool
    DIR/generate/config.pbtxt + 1/model.py   decoupled, the co-located baseline (prefill engine's weights)

Templates live in model_repository/. Rendering fails on any placeholder left unfilled or any value
that no template uses, and the result is written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass

import model_repository
from engine.lora_files import modules_text
from tandem.manifest import ManifestError, check_pair, read_manifest
from tandem.modes import HandoffMode
from tandem.roles import Role

TEMPLATES = os.path.dirname(model_repository.__file__)
MODELS = tuple(r.value for r in Role)  # one Triton model per role, named by it
_PLACEHOLDER = re.compile(r"\$\{([a-z_]+)\}")


class RenderError(ValueError):
    """A template and its values do not match; the message names the keys."""


def render(template: str, values: dict, where: str) -> str:
    wanted = set(_PLACEHOLDER.findall(template))
    missing, unused = wanted - set(values), set(values) - wanted
    if missing or unused:
        raise RenderError(f"{where}: unfilled placeholders {sorted(missing)}; values no placeholder uses "
                          f"{sorted(unused)}")
    for key, value in values.items():
        if isinstance(value, str) and ('"' in value or "\\" in value or "\n" in value):
            raise RenderError(f"{where}: value of {key!r} may not contain quotes, backslashes or newlines")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


TRANSPORT_CHOICES = ("shm", "cuda_ipc", "nixl", "auto")  # auto: the one-host transport, and NIXL where installed
HANDOFF_CHOICES = tuple(m.value for m in HandoffMode)  # see control/handoff.py


@dataclass(frozen=True)
class RepoOptions:
    transport: str | None = None  # None: the one-host transport for the decode pool's memory (shm or cuda_ipc)
    threads: int = 1  # torch threads per model instance
    kv_pool_bytes: int | None = None  # None: the decode profile's
    transfer_timeout_s: float = 30.0  # decode: a started request whose pages never arrive fails after this
    fence_timeout_s: float = 60.0  # a NIXL writer (decode) or pull reader (prefill) never heard from is assumed gone
    chunk_tokens: int = 0  # generate/: 0 = prefill-first co-location, N = chunked prefill
    decode_chunk_tokens: int = 64  # decode/: prompt tokens per step when it prefills a short suffix itself
    colocated_max_batch_size: int = 64
    max_num_seqs: int | None = None  # decode/, generate/: requests run at once; None: the decode profile's (64)
    max_num_batched_tokens: int | None = None  # prompt tokens per prefill pass; None: the prefill profile's
    fault_write_delay_ms: float = 0.0  # prefill/: fault injection only (tests, tandem chaos): a slow writer
    prefix_cache: bool = True  # every pool keeps finished requests' full pages for reuse (engine/prefix_cache.py)
    prefill_pool_bytes: int | None = None  # prefill/: its own pool (long prompts, its cache); None: the decode pool's
    handoff: str = HandoffMode.PUSH  # push: prefill writes into decode's pages; pull: prefill holds them, decode reads
    gpus: tuple[tuple[str, int], ...] = ()  # (model, GPU index) of models on a GPU (KIND_GPU); others: KIND_CPU
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, folder) of LoRA adapters requests may name (engine/lora.py)

    def __post_init__(self):
        if self.transport is not None and self.transport not in TRANSPORT_CHOICES:
            raise RenderError(f"unknown transport {self.transport!r}; allowed: {', '.join(TRANSPORT_CHOICES)}")
        if self.handoff not in HANDOFF_CHOICES:
            raise RenderError(f"unknown handoff mode {self.handoff!r}; allowed: {', '.join(HANDOFF_CHOICES)}")
        unknown = sorted({m for m, _ in self.gpus} - set(MODELS))
        if unknown or any(g < 0 for _, g in self.gpus):
            raise RenderError(f"gpus {list(self.gpus)}: models are {', '.join(MODELS)} and GPU indices 0 or more")


def _transports(choice: str | None, gpu_pool: bool, role: str = "decode") -> str:
    """The transports a pool offers (a decode pool, or a prefill pool in the pull handoff), for the
    config. One host: shm for a pool in host memory, cuda_ipc for one in GPU memory; auto adds NIXL where
    it is installed (for peers on other hosts)."""
    local = "cuda_ipc" if gpu_pool else "shm"
    if choice in ("shm", "cuda_ipc") and choice != local:
        where = "GPU" if gpu_pool else "host"
        raise RenderError(f"transport {choice} cannot reach a {role} pool in {where} memory; use {local}, nixl or "
                          f"auto (the {role} worker's device decides where its pool lives)")
    if choice in (None, "shm", "cuda_ipc"):
        return local
    if choice == "nixl":
        return choice
    import importlib.util

    nixl = any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12"))
    return f"{local},nixl" if nixl else local


def instance_group(gpu: int | None) -> str:
    """The config's instance group: one instance, on GPU `gpu` (Triton's numbering) or on the CPU."""
    return "KIND_CPU count: 1" if gpu is None else f"KIND_GPU count: 1 gpus: [ {gpu} ]"


def model_values(engines: str, opts: RepoOptions) -> dict[str, dict]:
    """Placeholder values per model, from the engines' manifests (refusing a mismatched pair)."""
    prefill_dir, decode_dir = (os.path.abspath(os.path.join(engines, r.value)) for r in (Role.PREFILL, Role.DECODE))
    try:
        pm, dm = read_manifest(prefill_dir), read_manifest(decode_dir)
        check_pair(pm, dm)
    except ManifestError as e:
        raise RenderError(str(e)) from None
    if pm.backend != "torch" or dm.backend != "torch":
        raise RenderError(f"{engines} holds {pm.backend} engines; this repository runs torch engines "
                          f"(render TensorRT-LLM role engines with `tandem repo --backend tensorrt-llm`)")
    pool = opts.kv_pool_bytes if opts.kv_pool_bytes is not None else dm.profile.kv_pool_bytes
    gpu = dict(opts.gpus)
    pass_tokens = opts.max_num_batched_tokens or pm.profile.max_num_tokens
    cpu_pass = opts.max_num_batched_tokens or pm.profile.cpu_pass_tokens or pm.profile.max_num_tokens
    cache = "on" if opts.prefix_cache else "off"
    loras = modules_text({name: os.path.abspath(folder) for name, folder in opts.lora_modules})
    return {
        "prefill": dict(name="prefill", engine_dir=prefill_dir, lora_modules=loras, max_batch_size=pm.profile.max_batch_size,
                        max_queue_delay_us=pm.profile.max_queue_delay_us, max_num_tokens=pass_tokens,
                        cpu_pass_tokens=cpu_pass, fault_write_delay_ms=opts.fault_write_delay_ms,
                        threads=opts.threads, prefix_cache=cache, instance_group=instance_group(gpu.get("prefill")),
                        handoff=opts.handoff, fence_timeout_s=opts.fence_timeout_s,
                        transports=_transports(opts.transport, "prefill" in gpu, "prefill") if opts.handoff == "pull"
                        else "",
                        pool_bytes=opts.prefill_pool_bytes if opts.prefill_pool_bytes is not None else pool),
        "decode": dict(name="decode", engine_dir=decode_dir, lora_modules=loras, transports=_transports(opts.transport, "decode" in gpu),
                       kv_pool_bytes=pool, max_batch_size=opts.max_num_seqs or dm.profile.max_batch_size,
                       max_num_tokens=pass_tokens, cpu_pass_tokens=cpu_pass,
                       chunk_tokens=opts.decode_chunk_tokens, transfer_timeout_s=opts.transfer_timeout_s,
                       fence_timeout_s=opts.fence_timeout_s, threads=opts.threads, prefix_cache=cache,
                       instance_group=instance_group(gpu.get("decode"))),
        "generate": dict(name="generate", engine_dir=prefill_dir, lora_modules=loras, kv_pool_bytes=pool,
                         max_batch_size=opts.max_num_seqs or opts.colocated_max_batch_size, max_num_tokens=pass_tokens,
                         cpu_pass_tokens=cpu_pass, chunk_tokens=opts.chunk_tokens, threads=opts.threads,
                         prefix_cache=cache, instance_group=instance_group(gpu.get("generate"))),
    }


def render_repo(engines: str, out: str, opts: RepoOptions = RepoOptions()) -> list[str]:
    """Write the repository to `out` (replacing what was there); return the model names."""
    values = model_values(engines, opts)

    def fill(tmp: str) -> None:
        for model in MODELS:
            write_model(os.path.join(tmp, model), os.path.join(TEMPLATES, model), values[model], f"{model}/config.pbtxt")

    write_replacing(out, fill)
    return list(MODELS)


def write_model(folder: str, template_dir: str, values: dict, where: str) -> None:
    """A model folder: template_dir's config.pbtxt rendered with `values`, beside its 1/model.py."""
    with open(os.path.join(template_dir, "config.pbtxt"), encoding="utf-8") as f:
        text = render(f.read(), values, where)
    os.makedirs(os.path.join(folder, "1"))
    with open(os.path.join(folder, "config.pbtxt"), "w", encoding="utf-8") as f:
        f.write(text)
    shutil.copyfile(os.path.join(template_dir, "1", "model.py"), os.path.join(folder, "1", "model.py"))


def write_replacing(out: str, fill) -> None:
    """`fill(folder)` a temporary folder beside `out`, then rename it to `out`, replacing what was there;
    nothing is left behind when `fill` fails."""
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".repo-", dir=parent)
    try:
        fill(tmp)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
