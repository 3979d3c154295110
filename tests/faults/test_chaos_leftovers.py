"""The chaos run's leftover check counts what its own deployment left, and nothing another deployment
or test run on the same machine has running at the time; and a pull-handoff deployment stopped while a
prefill worker holds a request's K/V for a (stopped) decode worker leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import yaml

from clients.chaos.leftovers import Tracker
from clients.sse_reader import sse_chunks
from engine.shm_region import SHM_DIR
from ops.serve_process import ServeProcess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAKE_SEGMENT = ("import time; from engine.shm_region import SharedBuffer; b = SharedBuffer.create(4096); "
                "print(b.name, flush=True); time.sleep(120)")


def _segment_maker(env: dict) -> tuple[subprocess.Popen, str]:
    """A process that made (and maps) a Tandem shm segment; the segment's name."""
    p = subprocess.Popen([sys.executable, "-c", MAKE_SEGMENT], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def test_a_run_counts_its_own_processes_and_shm_and_nobody_elses():
    tracker = Tracker()
    ours, our_shm = _segment_maker({**os.environ, **tracker.env})
    theirs, their_shm = _segment_maker(dict(os.environ))
    try:
        assert our_shm and their_shm
        tracker.look()
        left = tracker.leftovers()
        assert any(x.startswith(f"process {ours.pid} ") for x in left), left
        assert f"shm {our_shm}" in left, left
        assert not any(str(theirs.pid) in x or their_shm in x for x in left), left
        ours.kill()  # it dies without unlinking what it made
        ours.wait()
        assert tracker.leftovers() == [f"shm {our_shm}"]
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
            p.stdout.close()
        for name in (our_shm, their_shm):
            if name and os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
    assert tracker.leftovers() == []


async def _stop_while_held(serve: ServeProcess) -> int:
    """Stream a request until its first token (the prefill worker now holds its K/V: its decode worker
    is stopped and cannot read them), then stop the serve with the stream still open; its exit code."""
    body = {"prompt": "Tell me a long story about a lighthouse keeper.", "max_tokens": 64, "min_tokens": 64,
            "temperature": 0, "stream": True}  # min_tokens: a first token that ends the request holds nothing
    async with aiohttp.ClientSession() as s, s.post(f"{serve.http}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for chunk in sse_chunks(r):
            assert "error" not in chunk and chunk["choices"][0]["finish_reason"] is None, chunk
            if chunk["choices"][0]["text"]:
                break
        assert await _pages_held(s, serve.http) > 0  # the prefill worker holds the K/V at the stop
        return await asyncio.to_thread(serve.stop)


async def _pages_held(s: aiohttp.ClientSession, url: str, within_s: float = 20.0) -> float:
    """The prefill pool's held pages (/metrics) once they are above 0, or 0 if they are not within_s."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
        held = sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("tandem_kv_pages_held{") and 'role="prefill"' in line)
        if held > 0:
            return held
        await asyncio.sleep(0.2)
    return 0.0


def test_a_pull_stack_stopped_while_a_prefill_worker_holds_kv_leaves_nothing(built_engines, tmp_path):
    cfg = tmp_path / "pull.yaml"
    # the stopped decode worker stays in routing (no stall noticed for 2 minutes), so the hold lives on;
    # drain_grace_s 0: stop at once, with the request still held
    cfg.write_text(yaml.safe_dump({"handoff": {"mode": "pull"},
                                   "health": {"stall_s": 120, "stall_restart_s": 120, "drain_grace_s": 0}}))
    tracker = Tracker().start()
    try:
        serve = ServeProcess(str(tmp_path / "serve"), ("--model", str(built_engines), "--kv-pool-bytes",
                                                       str(256 << 20), "--config", str(cfg)), env=tracker.env)
        serve.start()
        try:
            with open(os.path.join(serve.workdir, "workers.json")) as f:
                os.kill(json.load(f)["decode-0"]["pid"], signal.SIGSTOP)  # it cannot read the held K/V
            code = asyncio.run(_stop_while_held(serve))
        finally:
            serve.stop()  # a no-op once stopped
    finally:
        tracker.stop()
    assert code == 0, serve.log_tail()
    assert tracker.owners, "the tracker never saw the deployment's processes"
    assert any(n.startswith("tandem-kv-") for n in tracker.shm), tracker.shm  # the pull pool was seen
    assert tracker.leftovers() == []
