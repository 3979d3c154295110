"""The engine manifest: what a role engine folder holds, read by `tandem serve` and the Triton models.

An engine folder is a Hugging Face style folder (config.json, safetensors, tokenizer.json,
tokenizer_config.json with the chat template) plus `manifest.json` describing the role build.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from tandem.kv_layout import KVLayout, KVLayoutMismatch, check_kv_compatible
from tandem.profiles import RoleProfile
from tandem.roles import Role

MANIFEST_FILE = "manifest.json"
FORMAT = "tandem-engine/1"
BACKENDS = ("torch", "tensorrt-llm")


class ManifestError(ValueError):
    """A manifest is missing, unreadable, or describes engines that cannot work together."""


@dataclass(frozen=True)
class EngineManifest:
    format: str
    tandem_version: str
    role: Role
    backend: str
    model_name: str
    architecture: str
    source: str
    source_digest: str  # fingerprint of the checkpoint the engine was built from
    dtype: str
    weight_files: tuple[str, ...]
    weights_digest: str  # sha256 over the weight files as written
    weights_bytes: int
    kv_layout: KVLayout
    profile: RoleProfile
    build_key: str  # digest of every build input: equal key means a rebuild would write the same engine
    build_time: str
    build_seconds: float

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(role=self.role.value, weight_files=list(self.weight_files), kv_layout=self.kv_layout.to_dict(),
                 profile=self.profile.to_dict())
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "EngineManifest":
        known = {f.name for f in fields(cls)}
        unknown, missing = set(data) - known, known - set(data)
        if unknown or missing:
            raise ManifestError(f"manifest has unknown keys {sorted(unknown)} / lacks keys {sorted(missing)}")
        if data["format"] != FORMAT:
            raise ManifestError(f"manifest format {data['format']!r} is not {FORMAT!r}; rebuild with this tandem")
        if data["backend"] not in BACKENDS:
            raise ManifestError(f"unknown backend {data['backend']!r}; allowed: {', '.join(BACKENDS)}")
        return cls(**dict(data, role=Role.parse(data["role"]), weight_files=tuple(data["weight_files"]),
                          kv_layout=KVLayout.from_dict(data["kv_layout"]),
                          profile=RoleProfile.from_dict(data["profile"])))

    def write(self, folder: str) -> None:
        with open(os.path.join(folder, MANIFEST_FILE), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")


def read_manifest(folder: str) -> EngineManifest:
    path = os.path.join(folder, MANIFEST_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return EngineManifest.from_dict(json.load(f))
    except FileNotFoundError:
        raise ManifestError(f"{folder} is not an engine folder: no {MANIFEST_FILE} (build one with 'tandem build')") \
            from None
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ManifestError(f"cannot read {path}: {e}") from e


def check_pair(prefill: EngineManifest, decode: EngineManifest) -> None:
    """Refuse a prefill/decode pair that cannot hand KV pages to each other (names field and values)."""
    if prefill.role is not Role.PREFILL or decode.role is not Role.DECODE:
        raise ManifestError(f"expected a prefill and a decode engine, got {prefill.role.value} and {decode.role.value}")
    for name in ("architecture", "source_digest"):
        a, b = getattr(prefill, name), getattr(decode, name)
        if a != b:
            raise ManifestError(f"prefill and decode engines come from different checkpoints: {name} is {a!r} "
                                f"vs {b!r}; build both roles from the same checkpoint")
    try:
        check_kv_compatible(prefill.kv_layout, decode.kv_layout)
    except KVLayoutMismatch as e:
        raise ManifestError(str(e)) from None


