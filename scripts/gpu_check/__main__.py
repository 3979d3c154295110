"""`scripts/gpu-check`: the prepared device check. Sections run in order, each timed; a failing
section is reported (its error in the table and the JSON) and the others still run.

    scripts/gpu-check [--out FILE] [--model CKPT] [--kit DIR]      # on one CUDA GPU, under 8 minutes
    scripts/gpu-check --dry-run                                    # every section small, on CPU
    scripts/gpu-check --prepare-kit DIR                            # the ~2 MB kit to carry (docs/gpu.md)

Exit status 0 when every correctness check held (fp32 = transformers, graphs = eager, the 1P1D answer
exact, a LoRA adapter's tokens = the CPU's and mixed with base rows, IPC bytes intact, pull reads exact
and refused once their hold ended), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch

from scripts.gpu_check import (decode_bench, device_rates, exactness_check, ipc_check, lora_check, pair_check,
                               pull_check)
from scripts.gpu_check.report_table import table, write_json
from scripts.gpu_check.synthetic_model import model_folder, prepare_kit

DEFAULT_KIT = ".gpu-check/kit"


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int
    matmul_n: int
    prompts: int
    answer_tokens: int
    batches: tuple[int, ...]
    decode_steps: int
    decode_prompt_len: int
    prefill_prompts: int
    prefill_len: int
    ipc_bytes: int
    kv_bytes: int
    pull_pages: int  # pages (of pull_check.LAYOUT: 512 KiB each) one pull read moves


FULL = Sizes(copy_bytes=1 << 30, matmul_n=8192, prompts=8, answer_tokens=32, batches=(1, 8, 64, 256),
             decode_steps=24, decode_prompt_len=96, prefill_prompts=8, prefill_len=1024, ipc_bytes=1 << 30,
             kv_bytes=4 << 30, pull_pages=256)
DRY = Sizes(copy_bytes=16 << 20, matmul_n=256, prompts=3, answer_tokens=6, batches=(1, 8), decode_steps=3,
            decode_prompt_len=16, prefill_prompts=2, prefill_len=32, ipc_bytes=1 << 20, kv_bytes=16 << 20,
            pull_pages=8)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (with --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="every section, small sizes (runs on CPU)")
    ap.add_argument("--model", default=None, help="a checkpoint on this machine (HF folder, .gguf, name); "
                                                  "default: synthetic weights with the kit's architecture")
    ap.add_argument("--kit", default=DEFAULT_KIT, help=f"tokenizer + config kit (default {DEFAULT_KIT})")
    ap.add_argument("--prepare-kit", metavar="DIR", default=None, help="write the kit to DIR and exit")
    ap.add_argument("--out", default=None, help="JSON file (default $OUT/gpu-check.json, else ./gpu-check.json)")
    return ap.parse_args(argv)


def _section(results: dict, name: str, fn, *args) -> object:
    t0 = time.perf_counter()
    sec = {"results": {}, "error": None}
    try:
        value = fn(*args)
        if isinstance(value, str):
            sec["skipped"] = value
        else:
            sec["results"] = value
    except Exception as e:  # a broken section must not hide the others' numbers: report it and go on
        sec["error"] = f"{type(e).__name__}: {e}"
    sec["seconds"] = round(time.perf_counter() - t0, 2)
    results["sections"][name] = sec
    print(f"[gpu-check] {name}: {'error' if sec['error'] else 'done'} in {sec['seconds']:.1f} s", flush=True)
    return sec["results"]


def run(args: argparse.Namespace, results: dict) -> None:
    """Fill `results` section by section (what finished stays there if a later step fails)."""
    from engine.load import load_engine

    device = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA device is visible; run with --dry-run (CPU) to check the script")
    z = DRY if args.dry_run else FULL
    on_gpu = device.type == "cuda"
    work = tempfile.mkdtemp(prefix="gpu-check-")
    results |= {"env": device_rates.environment(device), "dry_run": args.dry_run}
    try:
        folder, results["model"] = model_folder(args.model, args.kit, work, args.dry_run)
        rates = _section(results, "device_rates", lambda: {
            "copy": device_rates.copy_bandwidth(device, z.copy_bytes),
            "matmul_bf16": device_rates.matmul_rate(device, torch.bfloat16, z.matmul_n)})
        copy_gbps = rates.get("copy", {}).get("read_write_gbps", 1.0)
        tflops = rates.get("matmul_bf16", {}).get("tflops", 1.0)

        def engine(dtype, dev: str = str(device), lora_modules: dict | None = None):
            e = load_engine(folder, dtype=dtype, device=dev, kv_bytes=z.kv_bytes, lora_modules=lora_modules)
            if dev == "cpu":
                e.use_decode_graphs(list(z.batches), capture=False)  # the padded static path, uncaptured
            return e

        e32 = engine("float32")
        prompts = exactness_check.prompt_ids(e32, z.prompts)
        answers: list = []

        def fp32():
            res, ours = exactness_check.fp32_checks(e32, folder, prompts, z.answer_tokens)
            answers.extend(ours)
            return res

        _section(results, "fp32_exactness", fp32)
        expected = [exactness_check.run_batch(e32, [p], z.answer_tokens)[0] for p in prompts[:4]]
        _section(results, "1p1d", pair_check.one_prefill_one_decode, e32, prompts[:4], expected, z.answer_tokens)
        lora_dir = lora_check.write_adapter(os.path.join(work, "lora"), e32.cfg)
        del e32
        _section(results, "lora_exactness", lora_check.exactness, engine, lora_dir, device, prompts[:4],
                 z.answer_tokens)
        e16 = engine("bfloat16")
        _section(results, "bf16_sanity", lambda: exactness_check.bf16_sanity(
            e16, prompts, z.answer_tokens, answers) if answers else "no fp32 answers to compare with")
        _section(results, "decode", lambda: {f"batch {b} {'graphs' if g else 'eager'}": decode_bench.decode_rate(
            e16, b, z.decode_steps, z.decode_prompt_len, copy_gbps, g) for b in z.batches for g in (True, False)})
        _section(results, "prefill", lambda: decode_bench.prefill_rate(
            e16, z.prefill_prompts, z.prefill_len, tflops))
        del e16
        _section(results, "lora_decode", lambda: lora_check.decode_cost(
            engine("bfloat16", lora_modules={"tuned": lora_dir}), z.batches[-1], z.decode_steps))
        _section(results, "cuda_ipc", lambda: {
            "one_process_d2d": ipc_check.in_process_copy(device, z.ipc_bytes),
            "two_processes": ipc_check.two_process_copy(device, z.ipc_bytes)} if on_gpu else "needs CUDA")
        _section(results, "nixl_vram", lambda: ipc_check.nixl_vram(device, z.ipc_bytes) if on_gpu and
                 ipc_check.nixl_available() else "needs CUDA and an importable nixl")
        pull = ("cuda_ipc", "nixl") if on_gpu else ("shm", "nixl")  # nixl on CPU: DRAM, as in the tests
        _section(results, "pull_read", lambda: {t: pull_check.read_check(t, device, z.pull_pages)
                                                for t in pull if t != "nixl" or ipc_check.nixl_available()})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def verdict(results: dict) -> bool:
    """Every section ran (or was skipped for a stated reason) and every correctness check held."""
    secs = results["sections"]
    if any(s["error"] for s in secs.values()):
        return False
    r = {k: s["results"] for k, s in secs.items()}
    exact = [r["fp32_exactness"]["vs_transformers"], r["1p1d"], r["lora_exactness"]["vs_cpu"],
             r["lora_exactness"]["mixed_batch"]]
    exact += [r["fp32_exactness"]["graphs_vs_eager"]] if "graphs_vs_eager" in r["fp32_exactness"] else []
    intact = [v["correct"] for v in r.get("cuda_ipc", {}).values()] + \
        ([r["nixl_vram"]["correct"]] if r.get("nixl_vram") else []) + \
        [v["correct"] for v in (r.get("pull_read") or {}).values()]
    return all(x["exact"] == x["of"] for x in exact) and all(intact)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare_kit:
        print(f"kit written to {prepare_kit(args.prepare_kit)}")
        return 0
    t_start = time.perf_counter()
    results = {"sections": {}, "env": {"torch": torch.__version__, "device": args.device}, "model": "?"}
    try:
        run(args, results)
    except Exception as e:  # e.g. the model did not load: keep what ran, say what stopped the rest
        results["fatal"] = f"{type(e).__name__}: {e}"
    results["total_seconds"] = round(time.perf_counter() - t_start, 1)
    results["passed"] = "fatal" not in results and verdict(results)
    out = args.out or os.path.join(os.environ.get("OUT") or ".", "gpu-check.json")
    print(table(results))
    if "fatal" in results:
        print(f"stopped early: {results['fatal']}")
    print(f"JSON: {write_json(results, out)}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
