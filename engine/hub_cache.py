"""Checkpoints named by Hugging Face repo id (`HuggingFaceTB/SmolLM2-135M-Instruct`), found in the local
Hugging Face cache, as vLLM users name them.

Tandem downloads nothing: a model named by repo id must already be in the cache (`hf download <id>` or
`huggingface-cli download <id>`, or a volume holding such a cache). The cache is where the Hugging Face
libraries put it: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
`~/.cache/huggingface/hub`. In it a repo is `models--<org>--<name>`, whose `refs/main` names the commit
whose files `snapshots/<commit>/` holds (a cache filled for one revision only may lack `refs/main`: its
one snapshot is taken).
"""

from __future__ import annotations

import os
import re

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_repo_id(name: str) -> bool:
    """Whether `name` reads as a Hugging Face repo id (org/name) rather than a path that exists."""
    return bool(_REPO_ID.fullmatch(name)) and not os.path.exists(name) and ".." not in name


def cache_root() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface", "hub")


def snapshot(repo_id: str) -> str | None:
    """The cached snapshot folder of `repo_id` (its `main` revision, or its only one), or None."""
    repo = os.path.join(cache_root(), "models--" + repo_id.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main"), encoding="utf-8") as f:
            commit = f.read().strip()
    except OSError:
        snapshots = os.path.join(repo, "snapshots")
        found = os.listdir(snapshots) if os.path.isdir(snapshots) else []
        if len(found) != 1:
            return None
        commit = found[0]
    folder = os.path.join(repo, "snapshots", commit)
    return folder if os.path.isdir(folder) else None
