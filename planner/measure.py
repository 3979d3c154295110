"""`tandem profile`: measure a `tandem-profile/1` profile of this machine and our PyTorch engine.

One worker of the profile is one engine with `threads` torch threads (one core per worker, as our
CPU layouts pin them). In order:
1. prefill passes: single prompts of several lengths and packed passes of several prompts;
2. decode steps: sets of sequences with short and longer contexts, prefilled for real (those
   passes are prefill points too), stepped at several batch sizes;
3. scaling: the same prefill pass and decode step with threads * N threads, for `scaling[N]`;
4. handoff: a memcpy stand-in (see timing.handoff_memcpy_gbps) unless a measured GB/s is given;
5. front door: the figures given (defaults from scripts/bench_frontdoor.py).
The fits are made from the points (see profile.fitted). The engine is imported here only.
"""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass

from planner.profile import FORMAT, Profile, fitted

COLOCATED_MAX_BATCH = 64  # the co-located worker's batch cap in the rendered model repository
CHUNK_TOKENS = 256  # `tandem serve --mode chunked`'s default chunk

# (tokens, sequences) of the prefill points
PREFILL_FULL = ((16, 1), (32, 1), (64, 1), (128, 1), (256, 1), (384, 1), (512, 1), (1024, 1),
                (128, 2), (256, 4), (512, 4), (512, 8))
PREFILL_QUICK = ((16, 1), (64, 1), (128, 1), (256, 1), (256, 4))
# (sequences, context per sequence, batch sizes) of the decode sets
DECODE_FULL = ((64, 32, (1, 4, 16, 64)), (16, 192, (1, 4, 16)))
DECODE_QUICK = ((16, 32, (1, 4, 16)), (4, 128, (1, 4)))


@dataclass(frozen=True)
class MeasureOptions:
    model: str = "smollm2-135m"
    name: str | None = None
    threads: int = 1
    scaling: str | None = None  # device counts "2,4" | "none" | None (powers of two that fit the cores)
    quick: bool = False
    kv_bytes: int = 256 << 20
    handoff_gbps: float | None = None
    handoff_latency_s: float = 0.0
    frontdoor_ttft_s: float = 1.5e-3
    frontdoor_per_token_s: float = 1e-4

    def scaling_devices(self) -> list[int]:
        """Device counts N to measure one worker on (N * threads threads each)."""
        cores = os.cpu_count() or 1
        if self.scaling is None:
            out, n = [], 2
            while n * self.threads <= cores:
                out.append(n)
                n *= 2
            return out
        if self.scaling.strip().lower() == "none":
            return []
        try:
            counts = sorted({int(x) for x in self.scaling.split(",") if x.strip()})
        except ValueError:
            raise ValueError(f"--scaling-devices {self.scaling!r}: give device counts like 2,4 or 'none'") from None
        if not counts or counts[0] < 2:
            raise ValueError(f"--scaling-devices {self.scaling!r}: device counts must be >= 2")
        return counts


def measure_profile(opts: MeasureOptions, log=print) -> Profile:
    """Measure and return a fitted profile; torch's thread count is restored afterwards."""
    import torch

    from engine.errors import EngineError
    from engine.load import load_engine

    devices = opts.scaling_devices()
    before = torch.get_num_threads()
    torch.set_num_threads(opts.threads)
    try:
        log(f"loading {opts.model} ...")
        try:
            engine = load_engine(_role_engine(opts.model), kv_bytes=opts.kv_bytes)
            return fitted(_measure(engine, opts, devices, log))
        except EngineError as e:  # a model that cannot load, or a KV pool too small for the decode points
            raise ValueError(f"{e} (model {opts.model!r}, --kv-bytes {opts.kv_bytes})") from None
    finally:
        torch.set_num_threads(before)


def _role_engine(model: str) -> str:
    """An engines folder (prefill/ + decode/, what `tandem serve --model` takes) is measured through its
    prefill engine (both roles hold the same weights); anything else is loaded as it is."""
    role = os.path.join(model, "prefill")
    return role if os.path.isdir(role) else model


def _measure(engine, opts: MeasureOptions, devices: list[int], log) -> Profile:
    import torch

    from planner import timing
    from tandem.profiles import DECODE, PREFILL

    gen = torch.Generator().manual_seed(0)
    repeats = 1 if opts.quick else 2
    timing.time_prefill(engine, 32, 1, 1, gen)  # warm-up: first passes allocate
    prefill = [_point(t, s, timing.time_prefill(engine, t, s, repeats, gen))
               for t, s in (PREFILL_QUICK if opts.quick else PREFILL_FULL)]
    log(f"prefill: {len(prefill)} passes measured")
    decode = []
    for count, context, batches in (DECODE_QUICK if opts.quick else DECODE_FULL):
        seqs = timing.decode_set(engine, count, context, gen, PREFILL.cpu_pass_tokens,
                                 lambda t, s, sec: prefill.append(_point(t, s, sec)))
        for b in batches:
            ctx, sec = timing.time_decode(engine, seqs[:b], 3)
            decode.append({"batch": b, "context_tokens": ctx, "seconds": sec})
        timing.release_all(engine, seqs)
    log(f"decode: {len(decode)} batch shapes measured")
    scaling = _scaling(engine, opts, devices, gen, log)
    if opts.handoff_gbps is None:
        gbps = timing.handoff_memcpy_gbps(engine, 64, 3)
        how = "memcpy stand-in: 64 KV pages of every layer copied between two tensors of the pool's layout"
    else:
        gbps, how = opts.handoff_gbps, "given with --handoff-gbps"
    log(f"handoff: {gbps:.2f} GB/s ({how.split(':')[0]})")
    return Profile.model_validate({
        "format": FORMAT,
        "name": opts.name or f"{_model_name(opts.model)} on {os.cpu_count()}-core {platform.machine()} CPU, "
                             f"{opts.threads} thread(s) per worker",
        "hardware": _hardware(opts, torch.__version__),
        "model": _model_info(engine, opts.model),
        "serving": {"pass_tokens": PREFILL.cpu_pass_tokens, "chunk_tokens": CHUNK_TOKENS,
                    "tokens_per_page": engine.tokens_per_page, "decode_max_batch": DECODE.max_batch_size,
                    "colocated_max_batch": COLOCATED_MAX_BATCH, "kv_pool_bytes": DECODE.kv_pool_bytes},
        "prefill": {"points": prefill, "how": "one packed engine.prefill pass of `sequences` random prompts of "
                                              "equal length; best of the repeats"},
        "decode": {"points": decode, "how": "engine.decode_step over prefilled sequences; best of 3 steps"},
        "scaling": scaling,
        "handoff": {"gbytes_per_s": gbps, "latency_s": opts.handoff_latency_s, "how": how},
        "frontdoor": {"ttft_s": opts.frontdoor_ttft_s, "per_token_s": opts.frontdoor_per_token_s,
                      "how": "given (defaults: scripts/bench_frontdoor.py, tandem serve vs direct to the workers)"},
        "sources": [{"what": "prefill, decode, scaling, handoff", "citation": "measured by tandem profile"}],
        "measured": {"command": _command(opts), "date": datetime.date.today().isoformat()},
    })


def _point(tokens: int, sequences: int, seconds: float) -> dict:
    return {"tokens": tokens, "sequences": sequences, "seconds": seconds}


def _scaling(engine, opts: MeasureOptions, devices: list[int], gen, log) -> dict:
    """Speedup of one prefill pass and one decode step with N * threads threads over `threads`."""
    import torch

    from planner import timing

    out: dict = {"prefill": {}, "decode": {}}
    if not devices:
        return out
    tokens = 128 if opts.quick else 256
    seqs: list = []
    try:
        for n in devices:
            seqs = timing.decode_set(engine, 16, 32, gen, 512, lambda *_: None)  # fresh: each run adds 12 tokens
            times = {1: [float("inf")] * 2, n: [float("inf")] * 2}  # threads factor -> [prefill, decode]
            for _ in range(3):  # alternate, so a burst of load elsewhere hits both settings alike
                for k in (1, n):
                    torch.set_num_threads(k * opts.threads)
                    t = times[k]
                    t[0] = min(t[0], timing.time_prefill(engine, tokens, 1, 1, gen))
                    t[1] = min(t[1], timing.time_decode(engine, seqs, 1)[1])
            out["prefill"][n] = times[1][0] / times[n][0]
            out["decode"][n] = times[1][1] / times[n][1]
            log(f"scaling: {n} devices ({n * opts.threads} threads): prefill x{out['prefill'][n]:.2f}, "
                f"decode x{out['decode'][n]:.2f}")
            timing.release_all(engine, seqs)
            seqs = []
    finally:
        torch.set_num_threads(opts.threads)
        timing.release_all(engine, seqs)
    out["how"] = (f"one {tokens}-token prefill pass and one decode step of 16 sequences, timed with N * "
                  f"{opts.threads} torch threads against {opts.threads}")
    return out


def _model_name(model: str) -> str:
    return os.path.basename(os.path.normpath(model))  # a name, never the machine's path to it


def _model_info(engine, model: str) -> dict:
    c = engine.cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size \
        + 2 * c.hidden_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    layout = engine.kv_layout()
    return {"name": _model_name(model), "params": embed + c.num_layers * per_layer + c.hidden_size,
            "kv_bytes_per_token": layout.bytes_per_token, "num_layers": c.num_layers, "dtype": layout.dtype,
            "weight_bytes": engine.model.weight_bytes}


def _hardware(opts: MeasureOptions, torch_version: str) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass  # not Linux: keep platform's name
    return {"device": f"CPU ({cpu}), {opts.threads} thread(s) per worker", "cores": os.cpu_count() or 1,
            "threads_per_worker": opts.threads, "torch": torch_version}


def _command(opts: MeasureOptions) -> str:
    parts = ["tandem profile", f"--model {_model_name(opts.model)}", f"--threads {opts.threads}"]
    if opts.quick:
        parts.append("--quick")
    if opts.handoff_gbps is not None:
        parts.append(f"--handoff-gbps {opts.handoff_gbps:g}")
    return " ".join(parts)
