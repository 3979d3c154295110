"""A running `tandem serve` (the real command, in its own process) for front-door tests."""

from __future__ import annotations

import pytest

from orchestrator.serve_process import ServeProcess
from tests.conftest import leak_check


def start_serve(engines, workdir, *extra) -> ServeProcess:
    return ServeProcess(str(workdir), ("--model", str(engines), "--kv-pool-bytes", str(256 << 20), *extra)).start()


def stop_serve(s: ServeProcess) -> None:
    assert s.stop() == 0, s.log_tail()
    assert leak_check() == []


@pytest.fixture(scope="session")
def served(built_engines, tmp_path_factory):
    s = start_serve(built_engines, tmp_path_factory.mktemp("serve-1p1d"))
    yield s
    stop_serve(s)
