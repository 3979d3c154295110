"""A user's Hugging Face folder on Kubernetes (deploy/kubernetes/components/model-volume) and in the
Compose stacks: engines built once into a shared volume by one step, read by every role. Kubernetes:
rendered with both overlays, valid for a current release, equal to `kubectl kustomize` when kubectl is
installed. Compose: `docker-compose config` when installed (tests/test_deploy_files.py parses the rest)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.kustomize import render
from tests.deploy.test_kubernetes import by_kind, tree  # noqa: F401 - `tree` is the fixture: a copy with a secret

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

SERVED = "/engines/served"
ROLES = ("tandem-prefill", "tandem-decode", "tandem-orchestrator")


@pytest.fixture(scope="module", params=["cpu", "gpu"], ids=["cpu-overlay", "nvidia-overlay"])
def overlay(request, tree):  # noqa: F811
    """An overlay of the user's: a shipped one plus the component, as docs/own-model.md shows."""
    folder = tree / "overlays" / f"own-{request.param}"
    folder.mkdir(exist_ok=True)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [f"../{request.param}"], "components": ["../../components/model-volume"]}))
    return folder


@pytest.fixture(scope="module")
def objects(overlay):
    return render(str(overlay))


def test_every_object_is_valid_for_a_current_kubernetes(objects):
    for obj in objects:
        kubernetes_validate.validate(obj, "1.32", strict=True)


def test_one_job_builds_the_engines_from_the_read_only_model_into_the_shared_volume(objects):
    claims = by_kind(objects, "PersistentVolumeClaim")
    assert set(claims) == {"tandem-model", "tandem-engines"}
    assert claims["tandem-engines"]["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on any node read it
    (job,) = by_kind(objects, "Job").values()
    spec = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v["persistentVolumeClaim"] for v in spec["volumes"]}
    assert volumes["model"] == {"claimName": "tandem-model", "readOnly": True}
    assert volumes["engines"] == {"claimName": "tandem-engines"}
    (c,) = spec["containers"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["model"]["readOnly"] and not mounts["engines"].get("readOnly")
    cmd = c["command"]
    flag = lambda f: cmd[cmd.index(f) + 1]  # noqa: E731
    assert cmd[:2] == ["tandem", "build"] and flag("--model") == mounts["model"]["mountPath"]
    assert flag("--out") == SERVED and SERVED.startswith(mounts["engines"]["mountPath"] + "/")
    assert spec["restartPolicy"] == "Never" and spec["securityContext"]["runAsNonRoot"]


def test_every_role_waits_for_the_built_engines_and_serves_them_read_only(objects):
    deployments = by_kind(objects, "Deployment")
    for name in ROLES:
        spec = deployments[name]["spec"]["template"]["spec"]
        assert {"name": "engines", "persistentVolumeClaim": {"claimName": "tandem-engines", "readOnly": True}} \
            in spec["volumes"]
        (wait,) = spec["initContainers"]
        script = " ".join(wait["command"])
        assert all(f"{SERVED}/{role}/manifest.json" in script for role in ("prefill", "decode"))
        for c in [wait, *spec["containers"]]:
            assert {"name": "engines", "mountPath": "/engines", "readOnly": True} in c["volumeMounts"]
        (c,) = spec["containers"]
        env = {e["name"]: e["value"] for e in c["env"]}
        if name == "tandem-orchestrator":  # `tandem serve --model <engines folder>` (TANDEM_MODEL)
            assert env["TANDEM_MODEL"] == SERVED and c["command"][:2] == ["tandem", "serve"]
        else:  # Kubernetes expands $(TANDEM_ENGINES) in the command from the container's env
            assert c["command"][c["command"].index("--engines") + 1] == "$(TANDEM_ENGINES)"
            assert env["TANDEM_ENGINES"] == SERVED


def kustomize_version() -> str | None:
    """The Kustomize version kubectl embeds ("v5.5.0"), or None: no kubectl, or one older than 1.21 (its
    Kustomize, v2, has no components and prints no version)."""
    if shutil.which("kubectl") is None:
        return None
    out = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"Kustomize Version: (v[\d.]+)", out)
    return found.group(1) if found else None


@pytest.mark.skipif(kustomize_version() is None, reason="no kubectl with Kustomize v4 or later (kubectl >= 1.21)")
def test_kubectl_kustomize_renders_the_same_objects(overlay, objects):
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=lambda o: (o["kind"], o["metadata"]["name"]))
    ours = sorted(objects, key=lambda o: (o["kind"], o["metadata"]["name"]))
    assert [(o["kind"], o["metadata"]["name"]) for o in theirs] == [(o["kind"], o["metadata"]["name"]) for o in ours]
    for a, b in zip(theirs, ours):
        if a["kind"] in ("Deployment", "Job", "PersistentVolumeClaim"):
            assert unordered(a["spec"]) == unordered(b["spec"]), a["metadata"]["name"]


def unordered(x):
    """`x` with its lists of named items (containers, env, volumes, mounts) in key order: where a patch
    puts a new item in such a list does not matter to Kubernetes."""
    if isinstance(x, dict):
        return {k: unordered(v) for k, v in x.items()}
    if isinstance(x, list):
        items = [unordered(v) for v in x]
        keyed = all(isinstance(v, dict) and ("name" in v or "mountPath" in v) for v in items)
        return sorted(items, key=lambda v: (v.get("name", ""), v.get("mountPath", ""))) if keyed and items else items
    return x
