"""Kubernetes manifests (deploy/kubernetes): both overlays render, every object is valid against a current
Kubernetes release's schema, and the pieces fit together (selectors, ports, probes, DNS names, policies,
budgets, the secret, the GPU additions)."""

from __future__ import annotations

import secrets
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.kustomize import KustomizeError, merge, render

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

SOURCE = "deploy/kubernetes"
WORKERS = ("prefill", "decode")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of deploy/kubernetes with the secret file a user generates before the first apply."""
    root = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(SOURCE, root)
    (root / "base" / "secret.txt").write_text(secrets.token_urlsafe(32))
    return root


# ids avoid the word "gpu": tests/conftest.py skips every test carrying that keyword on CPU machines
@pytest.fixture(scope="module", params=["cpu", "gpu"], ids=["cpu-overlay", "nvidia-overlay"])
def rendered(request, tree):
    return request.param, render(str(tree / "overlays" / request.param))


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def selects(selector: dict, labels: dict) -> bool:
    """Label-selector semantics (matchLabels and the In / NotIn / Exists / DoesNotExist expressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def pods(objects):
    """(deployment name, pod template labels, the template's containers) of every Deployment."""
    return [(n, d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"]["containers"])
            for n, d in by_kind(objects, "Deployment").items()]


def test_every_object_is_valid_for_a_current_kubernetes(rendered):
    _, objects = rendered
    version = kubernetes_validate.latest_version()
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} is not valid Kubernetes {version}: {e.message}")
    assert {o["kind"] for o in objects} >= {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget",
                                            "Secret", "ConfigMap", "Namespace"}
    assert all(o["metadata"].get("namespace") == "tandem" for o in objects if o["kind"] != "Namespace")


def test_services_select_existing_pods_on_declared_ports(rendered):
    _, objects = rendered
    for name, svc in by_kind(objects, "Service").items():
        targets = [c for _, labels, cs in pods(objects) if selects({"matchLabels": svc["spec"]["selector"]}, labels)
                   for c in cs]
        assert targets, f"Service {name} selects no pods"
        declared = {p.get("name") for c in targets for p in c.get("ports", [])}
        declared |= {p["containerPort"] for c in targets for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in declared, f"Service {name}: target port {port['targetPort']} not declared"
    front = by_kind(objects, "Service")["tandem"]["spec"]
    assert front["type"] == "ClusterIP" and {(p["name"], p["port"]) for p in front["ports"]} == {("http", 8000),
                                                                                                 ("grpc", 8001)}


def test_workers_are_found_through_headless_services_named_in_the_orchestrator_config(rendered):
    _, objects = rendered
    config = yaml.safe_load(by_kind(objects, "ConfigMap")["tandem-orchestrator"]["data"]["deployment.yaml"])
    assert config["transport"] == "nixl" and config["front_door"]["host"] == "0.0.0.0"
    for role in WORKERS:
        svc = by_kind(objects, "Service")[f"tandem-{role}"]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"].get("publishNotReadyAddresses", False) is False
        host, port = config[role]["dns"].rsplit(":", 1)
        assert host == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
        assert int(port) in {p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"}
        assert config[role]["count"] == 0


def test_probes_use_triton_health_on_declared_ports(rendered):
    _, objects = rendered
    for name, _, containers in pods(objects):
        for c in containers:
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c[kind]
                action = probe.get("httpGet") or probe.get("tcpSocket")
                assert action["port"] in ports or action["port"] in ports.values(), f"{name} {kind}"
            if name != "tandem-orchestrator":
                assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
                assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
            else:
                assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert c["resources"]["requests"] and c["resources"]["limits"]


def test_worker_commands_follow_the_worker_contract(rendered):
    _, objects = rendered
    for role in WORKERS:
        (c,) = by_kind(objects, "Deployment")[f"tandem-{role}"]["spec"]["template"]["spec"]["containers"]
        cmd = c["command"]
        flag = lambda f: cmd[cmd.index(f) + 1]  # noqa: E731
        assert cmd[:2] == ["tandem", "worker"] and flag("--role") == role and flag("--transport") == "nixl"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert (int(flag("--grpc-port")), int(flag("--http-port")), int(flag("--metrics-port"))) == (
            ports["grpc"], ports["http"], ports["metrics"])
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["UCX_NET_DEVICES"] == "eth0" and "tcp" in env["UCX_TLS"].split(",")
        engines = flag("--engines")  # $(VAR): Kubernetes expands it only when the container's env defines VAR
        assert env.get(engines[2:-1], "").startswith("engines/") if engines.startswith("$(") else engines


def test_network_policies_let_only_the_orchestrator_reach_triton_and_prefill_reach_decode(rendered):
    _, objects = rendered
    policies = list(by_kind(objects, "NetworkPolicy").values())
    deployments = pods(objects)

    def allowed(src: str, dst: str, port: int) -> bool:
        """Does some policy admit TCP from pods of Deployment src to pods of dst on port?"""
        src_labels = next(lbl for n, lbl, _ in deployments if n == src)
        dst_labels = next(lbl for n, lbl, _ in deployments if n == dst)
        mine = [p for p in policies if selects(p["spec"]["podSelector"], dst_labels)]
        if not mine:
            return True  # a pod no policy selects takes all traffic
        for rule in (r for p in mine for r in p["spec"].get("ingress", [])):
            peers = rule.get("from")
            if peers is not None and not any(selects(f["podSelector"], src_labels) for f in peers if "podSelector" in f):
                continue
            if any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule.get("ports", [])):
                return True
        return False

    ucx = {}
    for name, _, (c, *_) in deployments:
        ucx[name] = next((e["value"] for e in c["env"] if e["name"] == "UCX_TCP_PORT_RANGE"), None)
    low, high = map(int, ucx["tandem-decode"].split("-"))
    assert ucx["tandem-prefill"] == ucx["tandem-decode"]
    for role in WORKERS:
        for port in (8000, 8001, 8002):
            assert allowed("tandem-orchestrator", f"tandem-{role}", port)
            assert not allowed("tandem-prefill" if role == "decode" else "tandem-decode", f"tandem-{role}", port)
        assert not allowed("tandem-orchestrator", f"tandem-{role}", low)
    assert allowed("tandem-prefill", "tandem-decode", low) and allowed("tandem-prefill", "tandem-decode", high)
    assert not allowed("tandem-prefill", "tandem-decode", high + 1)
    assert allowed("tandem-orchestrator", "tandem-orchestrator", 8000)  # the front door stays open to clients
    for p in policies:  # no policy selects nothing (a typo in a label would)
        assert any(selects(p["spec"]["podSelector"], lbl) for _, lbl, _ in deployments), p["metadata"]["name"]


def test_one_disruption_budget_per_role_selecting_exactly_that_role(rendered):
    _, objects = rendered
    budgets = by_kind(objects, "PodDisruptionBudget")
    for role in ("orchestrator", *WORKERS):
        hits = [n for n, lbl, _ in pods(objects) if selects(budgets[f"tandem-{role}"]["spec"]["selector"], lbl)]
        assert hits == [f"tandem-{role}"]


def test_the_secret_is_mounted_as_a_file_and_no_value_is_committed(rendered):
    _, objects = rendered
    (secret,) = by_kind(objects, "Secret").values()
    for name, d in by_kind(objects, "Deployment").items():
        spec = d["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        path = next(e["value"] for e in c["env"] if e["name"] == "TANDEM_SECRET_FILE")
        vol = next(v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == secret["metadata"]["name"])
        mount = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
        assert path.startswith(mount["mountPath"] + "/") and path.rsplit("/", 1)[1] in secret["data"], name
        assert not any(e["name"] == "TANDEM_SECRET" for e in c["env"]), "the secret is a file, never an env value"
    tracked = subprocess.run(["git", "ls-files", SOURCE], capture_output=True, text=True).stdout.split()
    assert f"{SOURCE}/base/secret.txt" not in tracked


def _without(cmd: list[str], flag: str) -> list[str]:
    """`cmd` without `flag` and its value."""
    return cmd[:cmd.index(flag)] + cmd[cmd.index(flag) + 2:] if flag in cmd else cmd


def test_gpu_overlay_adds_gpus_nvidia_image_and_placement_to_workers_only(tree):
    cpu, gpu = (by_kind(render(str(tree / "overlays" / o)), "Deployment") for o in ("cpu", "gpu"))
    for role in WORKERS:
        spec = gpu[f"tandem-{role}"]["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["image"].startswith("tandem-gpu")
        assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        cmd = c["command"]
        assert cmd[cmd.index("--device") + 1] == "cuda" and spec["hostIPC"] is True  # its engine on its GPU
        base = cpu[f"tandem-{role}"]["spec"]["template"]["spec"]["containers"][0]["command"]
        # the GPU command is the base's + device, its KV pool sized to the GPU's memory instead of given in bytes
        assert _without(_without(cmd, "--gpu-memory-utilization"), "--device") == _without(base, "--kv-pool-bytes")
        assert "--device" not in base and "--kv-pool-bytes" not in cmd
        env = {e["name"]: e["value"] for e in c["env"]}
        assert "cuda_copy" in env["UCX_TLS"] and env["UCX_TCP_PORT_RANGE"]  # patched one, kept the rest
        assert [p["name"] for p in c["ports"]] == ["http", "grpc", "metrics"]
        cpu_c = cpu[f"tandem-{role}"]["spec"]["template"]["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in cpu_c["resources"]["limits"]
        assert cpu_c["resources"]["requests"]["cpu"] == cpu_c["resources"]["limits"]["cpu"]  # Guaranteed QoS
    orch = gpu["tandem-orchestrator"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in orch["containers"][0]["resources"]["limits"] and "nodeSelector" not in orch


def test_renderer_merges_lists_by_key_and_refuses_what_it_does_not_model(tmp_path):
    base = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}],
                                     "args": ["p", "q"]}], "tolerations": [{"key": "k"}]}}
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "Y", "value": "3"}], "args": ["r"]}],
                      "tolerations": [{"key": "t"}]}}
    got = merge(base, patch)["spec"]
    assert got["containers"][0]["env"] == [{"name": "X", "value": "1"}, {"name": "Y", "value": "3"}]
    assert got["containers"][0]["args"] == ["r"] and got["tolerations"] == [{"key": "t"}]
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(KustomizeError, match="unsupported keys \\['commonLabels'\\]"):
        render(str(tmp_path))
    missing = tmp_path / "m"
    missing.mkdir()
    (missing / "kustomization.yaml").write_text("secretGenerator: [{name: s, files: [k=absent.txt]}]\n"
                                                "generatorOptions: {disableNameSuffixHash: true}\n")
    with pytest.raises(KustomizeError, match="absent.txt does not exist"):
        render(str(missing))
