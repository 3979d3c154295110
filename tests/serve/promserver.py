"""A real Prometheus server for tests: Debian's `prometheus` binary on 127.0.0.1 with a temporary
storage folder, scraping the given targets every second and evaluating the alert and recording rules
of deploy/kubernetes/components/monitoring/rules.yaml (a PrometheusRule; its `spec` is a plain rules
file). PromQL goes through its HTTP API (/api/v1/query).

    with Prometheus(workdir, {"front-door": ["127.0.0.1:8000"]}) as prom:
        prom.wait_for("up == 1")                 # the result vector, once it is not empty
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import yaml

from ops.triton_process import free_port

MONITORING = "deploy/kubernetes/components/monitoring"


class PrometheusError(RuntimeError):
    """Prometheus did not start, refused a query, or a query stayed empty past its deadline."""


def binary() -> str | None:
    return shutil.which("prometheus")


def write_rules(path: str) -> str:
    """The PrometheusRule's groups as a Prometheus rules file at `path` (what the Operator loads)."""
    with open(os.path.join(MONITORING, "rules.yaml")) as f:
        spec = yaml.safe_load(f)["spec"]
    with open(path, "w") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    return path


class Prometheus:
    """`targets`: {job name: ["host:port", ...]}, each scraped at /metrics every second."""

    def __init__(self, workdir: str, targets: dict[str, list[str]]):
        self.workdir, self.targets = workdir, targets
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "Prometheus":
        os.makedirs(self.workdir, exist_ok=True)
        rules = write_rules(os.path.join(self.workdir, "rules.yml"))
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "rule_files": [rules],
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(addrs)}]}
                                     for job, addrs in self.targets.items()]}
        path = os.path.join(self.workdir, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        self.log = open(os.path.join(self.workdir, "prometheus.log"), "w")
        self.proc = subprocess.Popen([binary(), f"--config.file={path}",
                                      f"--storage.tsdb.path={os.path.join(self.workdir, 'data')}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise PrometheusError(f"prometheus was not ready within {timeout_s:.0f}s:\n{self.log_tail()}")

    def query(self, expr: str) -> list[dict]:
        """The result of an instant query: [{"metric": {labels}, "value": [time, "text"]}, ...]
        (a scalar result comes back as one unlabelled element)."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            raise PrometheusError(f"{expr!r}: HTTP {e.code}: {e.read().decode()[:500]}") from None
        data = body["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def wait_for(self, expr: str, timeout_s: float = 60.0) -> list[dict]:
        """Poll `expr` until its result is not empty (a comparison filters the vector)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise PrometheusError(f"{expr!r} stayed empty for {timeout_s:.0f}s")
            time.sleep(0.5)

    def log_tail(self, n: int = 20) -> str:
        with open(os.path.join(self.workdir, "prometheus.log"), errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def values(result: list[dict]) -> list[float]:
    return [float(r["value"][1]) for r in result]
