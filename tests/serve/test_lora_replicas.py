"""Orchestrators (replicas behind one Service) sharing one decode worker, each loading a LoRA adapter
while serving: the worker holds every one's; when a replica stops, what the worker held for it alone
leaves the worker at once (control/adapters.py: release); when one is killed, it leaves once its watch
has been gone a while (engine/workers/adapter_set.py); the other replica's adapter stays throughout and
answers as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ops.triton_process import free_port
from tests.conftest import leak_check, leak_snapshot, start_serve
from tests.engine.test_lora import TARGETS, make_adapter
from tests.serve.clients import post
from tests.serve.test_lora_loading import call, chat, held
from tests.serve.test_membership import ready, wait_until

pytest.importorskip("peft")
SHARED = "decode-r0"  # the remote decode worker, as every replica's /metrics names it
GONE = "went away without stopping: dropping its LoRA adapters"  # the worker's line when one expires


def worker_log(workdir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in workdir.glob("tandem-*.log"))


def test_a_replica_stopped_or_killed_takes_its_adapters_off_the_shared_worker(built_engines, hf_default_model,
                                                                              tmp_path):
    before = leak_snapshot()
    root = tmp_path / "root"
    for name, seed in (("x", 3), ("y", 4), ("z", 5)):
        make_adapter(hf_default_model[1], str(root / name), TARGETS, seed)
    g, h, m = free_port(), free_port(), free_port()
    worker = subprocess.Popen([sys.executable, "-m", "cli.main", "worker", "--role", "decode", "--engines",
                               str(built_engines), "--grpc-port", str(g), "--http-port", str(h), "--metrics-port",
                               str(m), "--kv-pool-bytes", str(128 << 20), "--workdir", str(tmp_path / "w"),
                               "--log-file"])
    cfg = tmp_path / "dep.yaml"  # each replica: its own prefill worker, the shared decode worker
    cfg.write_text(yaml.safe_dump({"decode": {"count": 0, "urls": [f"127.0.0.1:{g}"]},
                                   "lora_loading": {"root": str(root)}}))
    try:
        assert wait_until(lambda: ready(h), 300)
        a = start_serve(built_engines, tmp_path / "a", "--config", str(cfg))
        b = start_serve(built_engines, tmp_path / "b", "--config", str(cfg))
        c = None
        try:
            for s, name in ((a, "x"), (b, "y")):
                status, body = call(s.http, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(root / name)})
                assert status == 200, body
            assert wait_until(lambda: held(b.http).get(SHARED) == 2, 30), held(b.http)  # x for a, y for b
            answer = chat(b.http, "y")
            assert a.stop() == 0, a.log_tail()  # b still runs: what is left is checked at the end
            assert wait_until(lambda: held(b.http).get(SHARED) == 1, 30), held(b.http)  # x left with a
            assert GONE not in worker_log(tmp_path / "w")  # a said so itself
            assert chat(b.http, "y") == answer  # b's adapter stayed, and answers as before
            status, body = post(b.http, "/v1/chat/completions", {"model": "x", "max_tokens": 2,
                                                                  "messages": [{"role": "user", "content": "Hi"}]})
            assert status == 404 and "x" in body["error"]["message"], body  # never b's to serve

            c = start_serve(built_engines, tmp_path / "c", "--config", str(cfg))
            status, body = call(c.http, "/v1/load_lora_adapter", {"lora_name": "z", "lora_path": str(root / "z")})
            assert status == 200, body
            assert wait_until(lambda: held(b.http).get(SHARED) == 2, 30), held(b.http)  # y for b, z for c
            c.proc.kill()  # no stop: its watch of the worker breaks, and the worker is told nothing
            c.proc.wait(timeout=60)
            assert wait_until(lambda: held(b.http).get(SHARED) == 1, 60), held(b.http)  # z left after a while
            assert f"{GONE} ['z#" in worker_log(tmp_path / "w")
            assert chat(b.http, "y") == answer
        finally:
            for s in filter(None, (a, c)):
                if s.proc.poll() is None:
                    s.stop()
            assert b.stop() == 0, b.log_tail()
    finally:
        worker.terminate()
        assert worker.wait(timeout=120) == 0
    assert leak_check(before) == []
