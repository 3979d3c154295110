"""A small Kustomize renderer for the features deploy/kubernetes uses (test helper; `kubectl kustomize`
renders the same files the same way).

    objects = render("deploy/kubernetes/overlays/cpu")     # list of Kubernetes objects (dicts)

Supported kustomization keys: `resources` (YAML files and directories with their own kustomization),
`namespace`, `secretGenerator` (files and literals, with `generatorOptions.disableNameSuffixHash: true`),
`patches` (strategic-merge patches from `path`, optionally applied to a `target` kind/name) and
`components` (folders whose `kind: Component` kustomization adds its resources and patches to what the
including kustomization has rendered so far, as Kustomize applies them before the includer's patches). Any
other key is refused with the list of supported ones, so a manifest cannot silently rely on a
feature this renderer would ignore. Strategic merge follows Kubernetes' rules for the fields the
manifests patch: maps merge, lists of containers/env/volumes/volumeMounts/ports merge by their key,
every other list is replaced, and a null value deletes a key.
"""

from __future__ import annotations

import base64
import copy
import os

import yaml

KEYS = ("resources", "namespace", "secretGenerator", "generatorOptions", "patches", "components")
COMPONENT_KEYS = ("apiVersion", "kind", "resources", "patches")
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                  "PriorityClass", "CustomResourceDefinition"}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not support, or refers to a missing thing."""


def render(folder: str) -> list[dict]:
    """All objects the kustomization in `folder` produces, in resource order."""
    path = os.path.join(folder, "kustomization.yaml")
    if not os.path.isfile(path):
        raise KustomizeError(f"{folder}: no kustomization.yaml")
    with open(path) as f:
        k = yaml.safe_load(f) or {}
    unknown = sorted(set(k) - set(KEYS))
    if unknown:
        raise KustomizeError(f"{path}: unsupported keys {unknown}; supported: {', '.join(KEYS)}")
    objects: list[dict] = []
    for res in k.get("resources", []):
        target = os.path.normpath(os.path.join(folder, res))
        objects += render(target) if os.path.isdir(target) else load(target)
    objects += [secret(folder, g, k.get("generatorOptions", {})) for g in k.get("secretGenerator", [])]
    for comp in k.get("components", []):
        component(os.path.normpath(os.path.join(folder, comp)), objects)
    for patch in k.get("patches", []):
        apply_patch(folder, patch, objects)
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    return objects


def component(folder: str, objects: list[dict]) -> None:
    """Add the component in `folder` to `objects`: its resources, then its patches (over all of them)."""
    path = os.path.join(folder, "kustomization.yaml")
    if not os.path.isfile(path):
        raise KustomizeError(f"component {folder}: no kustomization.yaml")
    with open(path) as f:
        k = yaml.safe_load(f) or {}
    if k.get("kind") != "Component":
        raise KustomizeError(f"{path}: a component's kustomization needs kind: Component")
    unknown = sorted(set(k) - set(COMPONENT_KEYS))
    if unknown:
        raise KustomizeError(f"{path}: unsupported keys {unknown}; supported: {', '.join(COMPONENT_KEYS)}")
    for res in k.get("resources", []):
        objects += load(os.path.join(folder, res))
    for patch in k.get("patches", []):
        apply_patch(folder, patch, objects)


def load(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise KustomizeError(f"resource {path} does not exist")
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def secret(folder: str, gen: dict, options: dict) -> dict:
    """A generated Secret. Name suffix hashes are not modelled, so the kustomization must disable them."""
    if not options.get("disableNameSuffixHash"):
        raise KustomizeError("secretGenerator needs generatorOptions.disableNameSuffixHash: true here")
    data = {}
    for item in gen.get("files", []):
        key, _, rel = item.rpartition("=") if "=" in item else (os.path.basename(item), "", item)
        src = os.path.join(folder, rel)
        if not os.path.isfile(src):
            raise KustomizeError(f"secretGenerator {gen['name']}: file {src} does not exist (create it first)")
        with open(src, "rb") as f:
            data[key] = base64.b64encode(f.read()).decode()
    for item in gen.get("literals", []):
        key, _, value = item.partition("=")
        data[key] = base64.b64encode(value.encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": gen.get("type", "Opaque"),
            "metadata": {"name": gen["name"]}, "data": data}


def apply_patch(folder: str, patch: dict, objects: list[dict]) -> None:
    docs = load(os.path.join(folder, patch["path"]))
    if len(docs) != 1:
        raise KustomizeError(f"patch {patch['path']}: one document per patch file, got {len(docs)}")
    doc = docs[0]
    target = patch.get("target") or {"kind": doc["kind"], "name": doc["metadata"]["name"]}
    hits = [o for o in objects if o["kind"] == target.get("kind", o["kind"])
            and o["metadata"]["name"] == target.get("name", o["metadata"]["name"])]
    if not hits:
        raise KustomizeError(f"patch {patch['path']}: no {target} among the resources")
    body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
    for obj in hits:
        merged = merge(obj, body)
        obj.clear()
        obj.update(merged)


def merge(base, patch):
    """Strategic merge of `patch` into a copy of `base` (see the module docstring for the rules)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out and isinstance(out[key], list) and isinstance(value, list):
                out[key] = merge_list(key, out[key], value)
            elif key in out:
                out[key] = merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    return copy.deepcopy(patch)


def merge_list(key: str, base: list, patch: list) -> list:
    mkey = MERGE_KEYS.get(key)
    if key == "ports" and all(isinstance(p, dict) for p in base + patch):
        mkey = "containerPort" if any("containerPort" in p for p in base + patch) else "port"
    if mkey is None or not all(isinstance(x, dict) and mkey in x for x in base + patch):
        return copy.deepcopy(patch)
    out = [copy.deepcopy(x) for x in base]
    for item in patch:
        at = next((i for i, x in enumerate(out) if x[mkey] == item[mkey]), None)
        if at is None:
            out.append(copy.deepcopy(item))
        else:
            out[at] = merge(out[at], item)
    return out
