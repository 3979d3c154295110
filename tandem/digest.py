"""Content digests of weight files (written into manifests at build, checked when an engine loads)."""

from __future__ import annotations

import hashlib
import os

from tqdm import tqdm

CHUNK = 8 << 20


def sha256_files(paths: list[str], desc: str = "hash") -> str:
    """sha256 over the files' contents in order, with a progress bar for large files."""
    h = hashlib.sha256()
    total = sum(os.path.getsize(p) for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=None, leave=False) as bar:
        for p in paths:
            with open(p, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    bar.update(len(chunk))
    return "sha256:" + h.hexdigest()
