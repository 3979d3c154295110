"""A model named by Hugging Face repo id, as vLLM users name it, found in the local Hugging Face cache
(engine/hub_cache.py): the default model's files laid out as the hub's cache lays them out (blobs,
snapshots of symlinks, refs/main). `tandem serve --model <repo id>` builds and serves it under that id
and answers as the default model does; a repo missing from the cache is one line saying how to fetch it;
a cache without refs/main is read from its one snapshot."""

from __future__ import annotations

import hashlib
import os

import pytest
import yaml

from engine.checkpoint import resolve
from engine.errors import ModelLoadError
from engine.hub_cache import snapshot
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import post
from tests.serve.test_startup_errors import one_error_line, run

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "c0ffee" + "0" * 34
ASK = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}


def hub_cache(root) -> str:
    """The default model's checkpoint files in a Hugging Face cache under `root` (returned): each file a
    blob named by its hash, the snapshot a folder of links to them, refs/main naming the snapshot."""
    source = resolve("smollm2-135m").folder
    repo = root / f"models--{REPO.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "refs").mkdir()
    for name in os.listdir(source):
        with open(os.path.join(source, name), "rb") as f:
            blob = hashlib.sha256(f.read(1 << 20)).hexdigest()
        (repo / "blobs" / blob).symlink_to(os.path.join(source, name))
        (repo / "snapshots" / COMMIT / name).symlink_to(f"../../blobs/{blob}")
    (repo / "refs" / "main").write_text(COMMIT)
    return str(root)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return hub_cache(tmp_path_factory.mktemp("hf-hub"))


def test_a_repo_id_is_read_from_the_cache_and_a_missing_one_says_how_to_fetch_it(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    got = resolve(REPO)
    assert got.folder == os.path.join(cache, f"models--{REPO.replace('/', '--')}", "snapshots", COMMIT)
    assert got.source == REPO and got.config == resolve("smollm2-135m").config
    with pytest.raises(ModelLoadError, match=r"no path here, nor a repo in the Hugging Face cache .*"
                                             r"hf download HuggingFaceTB/Other"):
        resolve("HuggingFaceTB/Other")
    os.remove(os.path.join(cache, f"models--{REPO.replace('/', '--')}", "refs", "main"))
    try:
        assert snapshot(REPO) == got.folder  # no refs/main: its one snapshot
    finally:
        with open(os.path.join(cache, f"models--{REPO.replace('/', '--')}", "refs", "main"), "w") as f:
            f.write(COMMIT)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # another cache: not there
    with pytest.raises(ModelLoadError, match=str(tmp_path / "hub")):
        resolve(REPO)


@pytest.fixture(scope="module")
def hub(cache, served, tmp_path_factory):
    """`tandem serve --model <repo id>` (engines built into the test's folder); `served` (the default
    model's stack, started first) answers the same questions."""
    work = tmp_path_factory.mktemp("serve-hub")
    (work / "dep.yaml").write_text(yaml.safe_dump({"engines": str(work / "engines")}))
    s = start_serve(REPO, work, "--config", str(work / "dep.yaml"), env={"HF_HUB_CACHE": cache})
    yield s
    stop_serve(s)


def test_serve_builds_and_serves_a_cached_repo_under_its_id(hub, served):
    status, models = post(hub.http, "/v1/chat/completions", ASK | {"model": REPO})
    assert status == 200 and models["model"] == REPO, models
    status, want = post(served.http, "/v1/chat/completions", ASK)
    assert status == 200 and models["choices"][0]["message"] == want["choices"][0]["message"]


def test_serve_of_a_repo_not_in_the_cache_is_one_line(tmp_path):
    code, err = run("serve", "--model", "HuggingFaceTB/Other", env={"HF_HUB_CACHE": str(tmp_path)})
    line = one_error_line(err)
    assert code != 0 and "hf download HuggingFaceTB/Other" in line, line
