"""The front doors and the orchestrator import no torch: they run in a small process, and a model
type never leaks into the control plane."""

from __future__ import annotations

import subprocess
import sys

FRONT = ["frontdoor.grpc_door", "frontdoor.http_app", "frontdoor.core", "frontdoor.kserve_codec", "control.orchestrator", "control.serving_path",
         "control.handoff", "control.channel", "control.fleet", "control.router",
         "ops.stack", "tandem.wire", "tandem.status", "tandem.sampling_params", "tandem.pool"]


def test_front_door_modules_do_not_import_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in FRONT) + \
        "heavy = sorted(m for m in ('torch', 'triton_python_backend_utils') if m in sys.modules)\nprint(heavy)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
