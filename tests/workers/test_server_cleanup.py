"""A Triton server stopped or killed while it is still loading its model leaves no shared memory behind:
the python backend makes its region before the server is ready, so the ready-time snapshot misses it."""

from __future__ import annotations

import os
import time

import pytest

from engine.shm_region import SHM_DIR, TRITON_PREFIX
from ops.triton_process import TritonServer
from tests.conftest import leak_check, leak_snapshot


def _regions() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(TRITON_PREFIX)}


@pytest.mark.parametrize("kill_first", [True, False], ids=["killed", "stopped"])
def test_a_server_ended_while_loading_leaves_nothing(rendered_repo, tmp_path, kill_first):
    before, regions_before = leak_snapshot(), _regions()
    server = TritonServer(str(rendered_repo), ("decode",), name="loading", log_dir=str(tmp_path)).launch()
    try:
        deadline = time.monotonic() + 60
        while not _regions() - regions_before and time.monotonic() < deadline:
            time.sleep(0.005)  # until the backend has made its region: the model is loading now
        assert _regions() - regions_before, "the python backend made no shared-memory region within 60 s"
        assert not server.shm_files  # not ready yet: nothing recorded
        if kill_first:
            server.kill()  # as `kill -9` of the group would, mid-load
    finally:
        server.stop()
    assert leak_check(before) == []
