"""Fingerprints that decide whether a build would change anything."""

from __future__ import annotations

import hashlib
import json
import os

# a checkpoint's small files: fingerprinted, and copied into each role engine where present
SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "generation_config.json")


def source_fingerprint(folder: str, weight_files: list[str]) -> str:
    """Cheap identity of a checkpoint: its small files' bytes and each weight file's name, size, mtime.

    Hashing multi-GB weights on every build would make a no-op rebuild slow; a changed weight file
    changes its size or modification time.
    """
    h = hashlib.sha256()
    for name in SMALL_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            h.update(name.encode())
            with open(path, "rb") as f:
                h.update(f.read())
    for path in sorted(weight_files):
        st = os.stat(path)
        h.update(f"{os.path.basename(path)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return "fp:" + h.hexdigest()[:32]


def build_key(**inputs) -> str:
    """Digest of every input to a role build; equal keys mean a rebuild would write the same engine."""
    return "bk:" + hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]
