"""`tandem profile --quick` on the real default model, as a user runs it (its own process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from planner.profile import load_profile


def test_quick_profile_of_the_default_model(tmp_path):
    out = tmp_path / "cpu.json"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "cli.main", "profile", "--quick", "--scaling-devices", "2",
                        "--handoff-gbps", "4.5", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    print(f"tandem profile --quick took {took:.1f} s")  # the goal (well under a minute) is reported, not asserted
    p = load_profile(str(out))
    assert p.model.name == "smollm2-135m" and p.model.kv_bytes_per_token == 30 * 3 * 64 * 2 * 4
    assert p.serving.pass_tokens == 512 and p.serving.tokens_per_page == 16
    assert len(p.prefill.points) >= 5 and len(p.decode.points) >= 4
    assert {pt.batch for pt in p.decode.points} >= {1, 4, 16}
    f, g = p.prefill.fit, p.decode.fit
    assert f.per_token_s > 0 and g.intercept_s > 0  # a pass costs per token; a step costs its weight reads
    # a 256-token pass costs over twice a 16-token one; a 16-sequence step more than a 1-sequence one
    assert min(pt.seconds for pt in p.prefill.points if pt.tokens == 256) > \
        2 * max(pt.seconds for pt in p.prefill.points if pt.tokens == 16)
    assert min(pt.seconds for pt in p.decode.points if pt.batch == 16) > \
        max(pt.seconds for pt in p.decode.points if pt.batch == 1)
    assert set(p.scaling.prefill) == {2} and set(p.scaling.decode) == {2}
    assert p.handoff.gbytes_per_s == 4.5 and p.handoff.how == "given with --handoff-gbps"
    assert p.frontdoor.ttft_s == 1.5e-3 and p.frontdoor.per_token_s == 1e-4
    assert p.measured.command == "tandem profile --model smollm2-135m --threads 1 --quick --handoff-gbps 4.5"
    assert str(tmp_path) not in out.read_text()  # no paths of this machine in the profile


def test_an_engines_folder_is_measured_through_its_prefill_engine(tmp_path):
    """`tandem serve --model` takes an engines folder (prefill/ + decode/); so does `tandem profile`."""
    from planner.measure import _role_engine

    (tmp_path / "engines" / "prefill").mkdir(parents=True)
    assert _role_engine(str(tmp_path / "engines")) == str(tmp_path / "engines" / "prefill")
    assert _role_engine("smollm2-135m") == "smollm2-135m"
