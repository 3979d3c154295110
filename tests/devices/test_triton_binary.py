"""Which tritonserver runs: TANDEM_TRITONSERVER, else the Triton image's own, else the nvidia-pytriton wheel's."""

from __future__ import annotations

import os
import stat

import pytest

from ops.triton_binary import OVERRIDE, TritonError, find_triton


def executable(path) -> str:
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_without_an_image_the_wheel_server_runs_with_its_libraries(tmp_path):
    b = find_triton(env={}, image_root=str(tmp_path / "no-image"))
    assert b.source == "nvidia-pytriton" and os.access(b.path, os.X_OK)
    assert os.path.isfile(os.path.join(b.backends, "python", "triton_python_backend_stub"))
    assert b.libs and os.path.isdir(b.libs)


def test_the_images_own_server_is_preferred_to_the_wheel(tmp_path):
    image = tmp_path / "opt" / "tritonserver"
    path = executable(image / "bin" / "tritonserver")
    b = find_triton(env={}, image_root=str(image))
    assert (b.source, b.path, b.backends, b.libs) == ("image", path, str(image / "backends"), None)


def test_the_override_wins_and_a_bad_one_is_refused(tmp_path):
    image = tmp_path / "opt" / "tritonserver"
    executable(image / "bin" / "tritonserver")
    mine = executable(tmp_path / "triton" / "bin" / "tritonserver")
    b = find_triton(env={OVERRIDE: mine}, image_root=str(image))
    assert (b.source, b.path, b.backends) == (OVERRIDE, mine, str(tmp_path / "triton" / "backends"))
    b = find_triton(env={OVERRIDE: mine, "TANDEM_TRITON_BACKENDS": "/b"}, image_root=str(image))
    assert b.backends == "/b"
    with pytest.raises(TritonError, match=f"{OVERRIDE}='/nowhere/tritonserver' is not an executable file"):
        find_triton(env={OVERRIDE: "/nowhere/tritonserver"})
