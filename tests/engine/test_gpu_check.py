"""The prepared device check runs end to end here, small and on CPU (`--dry-run`), so the script is
known to work before a GPU machine is lent: every section runs or is skipped for a stated reason, the
correctness checks hold, and the JSON carries the numbers the table shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpu_check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run([os.path.join(REPO, "scripts", "gpu-check"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_gpu_check_dry_run_on_cpu(tmp_path):
    kit = tmp_path / "kit"
    prep = _gpu_check("--prepare-kit", str(kit))
    assert prep.returncode == 0, prep.stderr
    assert sum(f.stat().st_size for f in kit.iterdir()) < 8 << 20, "the kit must stay small enough to carry"
    out = tmp_path / "result.json"
    run = _gpu_check("--dry-run", "--kit", str(kit), "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "verdict: PASS" in run.stdout
    res = json.loads(out.read_text())
    secs = res["sections"]
    assert set(secs) == {"device_rates", "fp32_exactness", "1p1d", "lora_exactness", "bf16_sanity", "decode",
                         "prefill", "lora_decode", "cuda_ipc", "nixl_vram", "pull_read"}
    assert not [k for k, s in secs.items() if s["error"]]
    fp32 = secs["fp32_exactness"]["results"]
    assert fp32["vs_transformers"]["exact"] == fp32["vs_transformers"]["of"] == 3
    assert fp32["vs_transformers"]["distinct_tokens"] > 3, "the synthetic model should not answer one token"
    assert secs["1p1d"]["results"]["exact"] == 3 and secs["1p1d"]["results"]["pages_left_in_use"] == 0
    assert "engine/workers" in secs["1p1d"]["results"]["runtime"]
    decode = secs["decode"]["results"]
    assert set(decode) == {"batch 1 graphs", "batch 1 eager", "batch 8 graphs", "batch 8 eager"}
    assert all(r["tokens_per_s"] > 0 and 0 < r["roofline_fraction"] for r in decode.values())
    assert secs["prefill"]["results"]["tokens_per_s"] > 0
    lora = secs["lora_exactness"]["results"]
    assert all(lora[k]["exact"] == lora[k]["of"] == 3 for k in ("vs_cpu", "mixed_batch")), lora
    cost = secs["lora_decode"]["results"]
    assert set(cost) == {"base", "adapter", "half"} and all(c["tokens_per_s"] > 0 for c in cost.values())
    assert secs["cuda_ipc"]["skipped"] == "needs CUDA"
    pull = secs["pull_read"]["results"]  # the pull read sides run on CPU too: shm, and NIXL DRAM where installed
    assert "shm" in pull and all(r["exact"] and r["late_read_refused"] for r in pull.values())
