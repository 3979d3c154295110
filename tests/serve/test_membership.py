"""The orchestrator follows its deployment while serving: a decode worker found by DNS name joins
routing; one listed by URL in a reloaded deployment file (SIGHUP) joins; one no longer listed drains
(it finishes what it has and gets nothing new)."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import subprocess
import sys
import time
import urllib.request

import yaml

from ops.triton_process import free_port
from tests.conftest import leak_check, leak_snapshot, start_serve, stop_serve
from tests.serve.clients import post


def requests_by_worker(http: str) -> dict[str, float]:
    with urllib.request.urlopen(http + "/metrics") as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^tandem_worker_requests_total\{role="decode",worker="([^"]+)"\} ([\d.e+]+)', text, re.M)}


def wait_until(cond, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.25)
    return False


def ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_workers_join_by_dns_and_reload_and_removed_ones_drain(built_engines, tmp_path):
    before = leak_snapshot()
    ports = [(free_port(), free_port(), free_port()) for _ in range(2)]
    extra = [subprocess.Popen([sys.executable, "-m", "cli.main", "worker", "--role", "decode", "--engines",
                               str(built_engines), "--grpc-port", str(g), "--http-port", str(h), "--metrics-port", str(m),
                               "--kv-pool-bytes", str(128 << 20), "--workdir", str(tmp_path / f"w{i}"), "--log-file"])
             for i, (g, h, m) in enumerate(ports)]
    cfg = tmp_path / "dep.yaml"
    # metrics name remote workers by slot, in the order they joined: the one found by DNS first, then the
    # listed one (it joins while the first still drains, so it takes the next slot)
    by_dns, by_url = "decode-r0", "decode-r1"
    try:
        assert wait_until(lambda: all(ready(h) for _, h, _ in ports), 300)
        cfg.write_text(yaml.safe_dump({"decode": {"count": 1, "dns": f"localhost:{ports[0][0]}"}}))
        s = start_serve(built_engines, tmp_path / "serve", "--config", str(cfg))
        try:
            def spread(n=12):
                with concurrent.futures.ThreadPoolExecutor(6) as pool:
                    results = list(pool.map(lambda i: post(s.http, "/v1/completions",
                                                           {"prompt": f"Count to {i}.", "max_tokens": 4}), range(n)))
                assert all(status == 200 for status, _ in results), results

            spread()
            assert requests_by_worker(s.http).get(by_dns, 0) > 0  # found through the name, and routed to
            cfg.write_text(yaml.safe_dump({"decode": {"count": 1, "urls": [f"127.0.0.1:{ports[1][0]}"]}}))
            s.proc.send_signal(signal.SIGHUP)  # reload: the URL joins, the DNS name is gone
            assert wait_until(lambda: "reloaded" in open(s.log_path).read())
            time.sleep(2.0)  # the new worker's watch connects
            dns_before = requests_by_worker(s.http).get(by_dns, 0)
            spread()
            counts = requests_by_worker(s.http)
            assert counts.get(by_url, 0) > 0  # the listed one is routed to
            assert counts.get(by_dns, 0) == dns_before  # the removed one drained: nothing new
        finally:
            stop_serve(s)
    finally:
        for p in extra:
            p.terminate()
        assert [p.wait(timeout=120) for p in extra] == [0, 0]
    assert leak_check(before) == []
