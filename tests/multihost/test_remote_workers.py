"""Three "hosts" (network namespaces): `tandem worker --role prefill` in one, `--role decode` in another,
`tandem serve` with both as remote workers in the third. The KV pages cross the link by NIXL over TCP,
greedy output equals single-process `tandem generate`, a caller without the deployment secret is
refused, and nothing is left behind. The workers serve TLS with certificates of the test's own CA (the
orchestrator sends the secret beyond loopback only over TLS), and the front door, beyond loopback,
takes only callers with an API key."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from engine.transports.nixl import available as nixl_available
from tests.conftest import leak_check, leak_snapshot
from tests.multihost import netns
from tests.multihost.test_nixl_hosts import ucx_env
from tests.serve.certs import TestCA

pytestmark = [pytest.mark.skipif(not nixl_available(), reason="NIXL not installed"),
              pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))]
PROMPT = "Name three planets of the solar system."
TANDEM = [sys.executable, "-m", "cli.main"]


def wait_http(url: str, timeout_s: float = 300.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[-12:]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not ready within {timeout_s:.0f}s")


API_KEY = "multi-host-test-api-key"


def worker(host, role: str, engines, secret_env: dict, log, tls) -> subprocess.Popen:
    return host.popen(TANDEM + ["worker", "--role", role, "--engines", str(engines), "--host", host.address,
                                "--transport", "nixl", "--threads", "1", "--kv-pool-bytes", str(128 << 20),
                                "--tls-cert", tls.cert, "--tls-key", tls.key],
                      env={**ucx_env(host), **secret_env}, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def cluster(built_engines, tmp_path_factory):
    work = tmp_path_factory.mktemp("multihost")
    secret = work / "secret"
    secret.write_text("multi-host-test-secret-0123456789\n")
    secret.chmod(0o600)
    env = {"TANDEM_SECRET_FILE": str(secret)}
    ca = TestCA(str(work))
    before = leak_snapshot()
    with netns.hosts(3) as (p, d, o):
        logs = {r: open(work / f"{r}.log", "w") for r in ("prefill", "decode", "serve")}
        procs = []
        try:
            procs += [worker(p, "prefill", built_engines, env, logs["prefill"], ca.issue("prefill", ips=(p.address,))),
                      worker(d, "decode", built_engines, env, logs["decode"], ca.issue("decode", ips=(d.address,)))]
            for host, proc in zip((p, d), procs):
                wait_http(f"http://{host.address}:8000/v2/health/ready", proc=proc)
            dep = work / "dep.yaml"
            dep.write_text(yaml.safe_dump({
                "engines": str(built_engines), "transport": "nixl",
                "prefill": {"count": 0, "urls": [f"{p.address}:8001"]},
                "decode": {"count": 0, "urls": [f"{d.address}:8001"]},
                "front_door": {"host": o.address, "grpc_port": 9001, "http_port": 9000},
                "worker_tls": {"ca": ca.path}}))
            procs.insert(0, o.popen(TANDEM + ["serve", "--config", str(dep), "--workdir", str(work / "serve")],
                                    env={**env, "TANDEM_API_KEY": API_KEY}, stdout=logs["serve"],
                                    stderr=subprocess.STDOUT))
            wait_http(f"http://{o.address}:9000/health", proc=procs[0])
            yield {"prefill": p, "decode": d, "orchestrator": o, "http": f"http://{o.address}:9000",
                   "grpc": f"{o.address}:9001", "work": work, "ca": ca.path}
        finally:
            for proc in procs:
                proc.terminate()  # SIGTERM: each stops its Triton and cleans up
            codes = [proc.wait(timeout=120) for proc in procs]
            for f in logs.values():
                f.close()
        assert codes == [0] * len(procs), open(work / "serve.log").read()[-3000:]
    assert leak_check(before) == []


def test_greedy_across_hosts_equals_tandem_generate_with_kv_over_nixl(cluster, built_engines):
    cli = subprocess.run(TANDEM + ["generate", "--model", str(built_engines / "prefill"), "--prompt", PROMPT,
                                   "--max-tokens", "24", "--no-chat", "--json"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    want = json.loads(cli.stdout)["text"]
    body = json.dumps({"prompt": PROMPT, "max_tokens": 24, "temperature": 0}).encode()
    req = urllib.request.Request(cluster["http"] + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:  # beyond loopback: no key, no answer
        urllib.request.urlopen(req, timeout=120)
    assert e.value.code == 401
    req.add_header("Authorization", f"Bearer {API_KEY}")
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.loads(r.read())["choices"][0]["text"] == want
    with urllib.request.urlopen(cluster["http"] + "/metrics") as r:
        metrics = r.read().decode()
    moved = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("tandem_kv_transfer_bytes_total{")}
    assert moved and all('transport="nixl"' in labels for labels in moved)  # different hosts: no shm possible
    assert sum(moved.values()) > 0  # the pages crossed from the prefill host to the decode host


def test_a_worker_off_loopback_refuses_a_caller_without_the_secret(cluster):
    d = cluster["decode"]
    c = grpcclient.InferenceServerClient(f"{d.address}:8001", ssl=True, root_certificates=cluster["ca"])
    try:
        t = grpcclient.InferInput("request", [1], "BYTES")
        t.set_data_from_numpy(np.array([json.dumps({"type": "stats", "body": {}}).encode()], dtype=np.object_))
        replies = []
        c.start_stream(callback=lambda result, error: replies.append((result, error)))
        c.async_stream_infer("decode", [t], request_id="intruder")
        c.stop_stream()
        (result, error), = replies
        assert error is None
        reply = json.loads(result.as_numpy("reply").reshape(-1)[0])
        assert reply["status"] == "UNAUTHENTICATED", reply
        with pytest.raises(InferenceServerException, match="restricted"):
            c.unload_model("decode")  # the admin API is locked with a key nobody has
    finally:
        c.close()
    req = urllib.request.Request(f"http://{d.address}:8000/v2/repository/models/decode/unload", data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 403
    with urllib.request.urlopen(f"http://{d.address}:8000/v2/health/ready", timeout=10) as r:
        assert r.status == 200  # probes stay open
