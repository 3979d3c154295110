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


def test_a_stopped_group_takes_its_own_segments_and_leaves_a_live_peers_pool(tmp_path):
    """A pull reader maps its prefill worker's pool (a push writer maps its decode worker's): stopping
    the reader's process group must unlink what it owned, never the live peer's pool it only mapped."""
    import subprocess
    import sys

    from engine.shm_region import SharedBuffer
    from ops.triton_process import stop_group

    peer = SharedBuffer.create(4096, tag="kv")  # owned by this (live) process
    child = subprocess.Popen([sys.executable, "-c", (
        "import mmap, os, sys, time\n"
        "from engine.shm_region import SharedBuffer\n"
        "own = SharedBuffer.create(4096, tag='kv')\n"
        f"fd = os.open({peer.path!r}, os.O_RDWR); view = mmap.mmap(fd, 4096)\n"
        "print(own.path, flush=True); time.sleep(600)\n")], stdout=subprocess.PIPE, text=True,
        start_new_session=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        own = child.stdout.readline().strip()
        assert os.path.exists(own) and os.path.exists(peer.path)
        stop_group(child.pid, timeout_s=5, proc=child)
        assert not os.path.exists(own)  # the stopped group's own segment is gone
        assert os.path.exists(peer.path)  # the live peer's pool it mapped stays
    finally:
        if child.poll() is None:
            child.kill()
        peer.close()
        peer.unlink()
