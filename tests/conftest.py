"""Shared fixtures: the real default model, loaded once per session, and leak checks."""

from __future__ import annotations

import os
import secrets
import signal
import time

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Every process this session starts inherits the tag, so leak checks count only what this session
# made: other sessions (another engineer's test run on the same machine) are not ours to judge.
SESSION_TAG = f"TANDEM_TEST_SESSION={os.environ.setdefault('TANDEM_TEST_SESSION', secrets.token_hex(6))}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def complete(engine, prompt_ids, params, request_id: str = "t"):
    """Run one request to its end in `engine` (prefill, then decode steps); return its Sequence."""
    seq = engine.new_sequence(request_id, prompt_ids, params)
    engine.admit(seq)
    engine.prefill([seq])
    while not seq.finished:
        engine.decode_step([seq])
    engine.release(seq)
    return seq


@pytest.fixture(scope="session")
def default_engine():
    """The default model (SmolLM2-135M-Instruct, fp32) with a 256 MiB local KV pool."""
    from engine.load import load_engine

    return load_engine("smollm2-135m", kv_bytes=256 << 20)


@pytest.fixture(scope="session")
def hf_default_model():
    """Hugging Face transformers' own load of the same GGUF: the exactness reference."""
    import importlib.util

    transformers = pytest.importorskip("transformers")
    from engine.checkpoint import KNOWN_MODELS

    package, filename, _ = KNOWN_MODELS["smollm2-135m"]
    folder = list(importlib.util.find_spec(package).submodule_search_locations)[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="session")
def built_engines(tmp_path_factory):
    """Prefill and decode engines of the default model, built once per session: engines/<name>/{prefill,decode}."""
    from builder.build import BuildRequest, build

    out = tmp_path_factory.mktemp("engines") / "smollm2"
    build(BuildRequest(model="smollm2-135m", out=str(out)), log=lambda *_: None)
    return out


def _session_pid(pid: str) -> bool:
    """Whether process `pid` belongs to this test session (this process, or one started with its tag)."""
    if int(pid) == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return SESSION_TAG.encode() in f.read().split(b"\0")
    except OSError:
        return False


def _maps_of(pid: str) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip().replace(" (deleted)", "") for line in f if " /dev/shm/" in line}
    except (OSError, IndexError):
        return set()


def _leftovers() -> set[str]:
    """This session's shm segments, Triton shm regions and tritonserver / stub processes alive now.

    A segment or region is another session's when only processes of other sessions map it."""
    import subprocess

    from engine.shm_region import our_segments

    foreign = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if not _session_pid(pid):
            foreign |= _maps_of(pid)
    names = [f"shared memory segment {s}" for s in our_segments()]
    names += [f"Triton shared memory {n}" for n in os.listdir("/dev/shm") if n.startswith("triton_python_backend")]
    found = {n for n in names if f"/dev/shm/{n.rsplit(' ', 1)[1]}" not in foreign}
    ps = subprocess.run(["pgrep", "-f", "tritonserver|triton_python_backend_stub"], capture_output=True, text=True)
    return found | {f"process {pid}" for pid in ps.stdout.split() if _session_pid(pid)}


def leak_snapshot() -> set[str]:
    """What already exists before a lifecycle test starts its servers (others' servers may be running)."""
    return _leftovers()


def leak_check(before: set[str] | None = None) -> list[str]:
    """What a finished lifecycle test left behind: shm segments and Triton processes not in `before`."""
    return sorted(_leftovers() - (before or set()))


@pytest.fixture(scope="session", autouse=True)
def nothing_left_at_the_end():
    """After every server of the session has been stopped, nothing the session made may remain.

    What existed before the session (another run's Triton killed with its stubs, say) is not ours.
    """
    before = leak_snapshot()
    yield
    assert leak_check(before) == []


@pytest.fixture(scope="session")
def rendered_repo(built_engines, tmp_path_factory):
    """The Triton model repository for the session's engines (shm transport, 128 MiB decode pool)."""
    from builder.repo import RepoOptions, render_repo

    out = tmp_path_factory.mktemp("repo") / "models"
    render_repo(str(built_engines), str(out), RepoOptions(kv_pool_bytes=128 << 20))
    return out


def start_serve(engines, workdir, *extra, env: dict | None = None, ca: str | None = None):
    """`tandem serve` in its own process on free ports, for the given engines (256 MiB decode pool);
    `env` adds to its environment, `ca`: its doors speak TLS with a certificate this CA signed."""
    from ops.serve_process import ServeProcess

    before = leak_snapshot()
    s = ServeProcess(str(workdir), ("--model", str(engines), "--kv-pool-bytes", str(256 << 20), *extra),
                     env=env, ca=ca).start()
    s.leak_baseline = before
    return s


def stop_serve(s) -> None:
    """Stop it as Ctrl-C would, and check that nothing of it is left behind."""
    assert s.stop() == 0, s.log_tail()
    assert leak_check(s.leak_baseline) == []


def sighup(s, says: str, timeout_s: float = 60.0) -> None:
    """Make `tandem serve` `s` reload (SIGHUP) and wait for the reload's log line, which must say `says`."""
    before = open(s.log_path).read().count("reload")
    s.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while open(s.log_path).read().count("reload") == before:
        assert time.monotonic() < deadline, s.log_tail()
        time.sleep(0.1)
    assert says in s.log_tail(3), s.log_tail(3)


def worker_events(s) -> list[str]:
    """What `tandem serve` `s` logged about its workers' health and restarts, oldest first."""
    with open(s.log_path) as f:
        return [line.split(" ", 2)[-1].rstrip() for line in f if "tandem.supervisor" in line or "tandem.fleet" in line]


@pytest.fixture(scope="session")
def served(built_engines, tmp_path_factory):
    """A running `tandem serve`, 1 prefill + 1 decode worker, default model (shared by front-door tests)."""
    s = start_serve(built_engines, tmp_path_factory.mktemp("serve-1p1d"))
    yield s
    stop_serve(s)


GUARD_KEY = "test-guarded-api-key-0123456789"


@pytest.fixture(scope="session")
def guarded(built_engines, tmp_path_factory):
    """A running `tandem serve` that wants the API key GUARD_KEY (TANDEM_API_KEY) and admits one request
    at a time (limits.max_in_flight 1: a second one is refused with 429 while the first is held)."""
    import yaml

    work = tmp_path_factory.mktemp("serve-guarded")
    cfg = work / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"limits": {"max_in_flight": 1}}))
    s = start_serve(built_engines, work, "--config", str(cfg), env={"TANDEM_API_KEY": GUARD_KEY})
    yield s
    stop_serve(s)
