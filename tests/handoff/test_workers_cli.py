"""`tandem workers up/down`: two pinned Triton instances that outlive the command, then nothing left."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import leak_check, leak_snapshot


def tandem(*args):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=300)


def test_up_status_down(built_engines, tmp_path):
    state = str(tmp_path / "state")
    before = leak_snapshot()
    up = tandem("workers", "up", "--engines", str(built_engines), "--kv-pool-bytes", str(64 << 20),
                "--state-dir", state)
    try:
        assert up.returncode == 0, up.stderr
        workers = json.loads((tmp_path / "state" / "workers.json").read_text())
        assert set(workers) == {"prefill-0", "decode-0"}
        assert all(w["grpc"].startswith("127.0.0.1:") and w["http"].startswith("127.0.0.1:") for w in workers.values())
        if len(os.sched_getaffinity(0)) > 1:
            assert not set(workers["prefill-0"]["cpus"]) & set(workers["decode-0"]["cpus"])
        for w in workers.values():
            assert os.sched_getaffinity(w["pid"]) == set(w["cpus"])
        status = tandem("workers", "status", "--state-dir", state)
        assert status.stdout.count(": up") == 2
        again = tandem("workers", "up", "--engines", str(built_engines), "--state-dir", state)
        assert again.returncode != 0 and "already up" in again.stderr
    finally:
        down = tandem("workers", "down", "--state-dir", state)
    assert down.returncode == 0, down.stderr
    assert leak_check(before) == []
