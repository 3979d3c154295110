"""`tandem status` (GET /admin/workers) shows an operator every worker a running `tandem serve` knows: the
routable ones with their load, and one it cannot reach, with why. A request is answered meanwhile."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import yaml

from tests.conftest import start_serve, stop_serve
from tests.serve.clients import post
from tests.serve.test_metrics import scrape

TANDEM = [sys.executable, "-m", "cli.main"]


def status(http: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(TANDEM + ["status", "--url", http, *extra], capture_output=True, text=True, timeout=60)


def test_status_lists_each_worker_with_its_state_load_and_why_one_is_not_ready(built_engines, tmp_path):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused, and nobody takes the port
    nobody = f"127.0.0.1:{dead.getsockname()[1]}"
    cfg = tmp_path / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"decode": {"count": 1, "urls": [nobody]}}))
    s = start_serve(built_engines, tmp_path / "serve", "--config", str(cfg))
    try:
        code, body = post(s.http, "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
        assert code == 200, body  # the local pair serves; the unreachable worker is not routed to
        seen = json.loads(status(s.http, "--json").stdout)
        assert seen["mode"] == "disaggregated" and seen["ready"] is True and seen["not_ready"] == []
        by_name = {w["name"]: w for w in seen["workers"]}
        assert sorted(by_name) == ["decode-0", f"decode@{nobody}", "prefill-0"]
        for name in ("decode-0", "prefill-0"):
            w = by_name[name]
            assert w["state"] == "routable" and w["why_not"] == "" and w["reported"]["pages_total"] > 0, w
        gone = by_name[f"decode@{nobody}"]
        assert gone["state"] == "not ready" and gone["reported"] is None and gone["failures"] >= 1
        assert "unreachable" in gone["why_not"] and "Connection refused" in gone["why_not"]

        table = status(s.http)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0] == "disaggregated: ready" and lines[1].split()[:3] == ["WORKER", "ROLE", "STATE"]
        rows = {ln.split()[0]: ln.split() for ln in lines[2:5]}
        assert rows["prefill-0"][1:3] == ["prefill", "routable"] and rows["decode-0"][1:3] == ["decode", "routable"]
        assert rows[f"decode@{nobody}"][1:4] == ["decode", "not", "ready"]
        assert lines[5].startswith(f"decode@{nobody}: ") and "Connection refused" in lines[5]
        samples, _ = scrape(s.http)
        routable = {dict(labels)["worker"]: v for (name, labels), v in samples.items() if name == "tandem_worker_routable"}
        assert routable == {"prefill-0": 1, "decode-0": 1, "decode-r0": 0}  # by slot, for an alert per worker
        with open(s.log_path) as f:  # once, not once per retry
            assert f.read().count(f"worker decode@{nobody} (decode) at {nobody} is not ready") == 1
    finally:
        stop_serve(s)
        dead.close()
    down = status(s.http)
    assert down.returncode == 1 and "cannot reach" in down.stderr and "is 'tandem serve' running?" in down.stderr
