"""Priority scheduling (`tandem serve --scheduling-policy priority`, vLLM's policy) on a real 1P1D stack:
a request of a lower priority value overtakes a backlog of others waiting for the decode worker's batch
(one request at a time here, `--max-num-seqs 1`) or for its pages (the orchestrator's waiting room), or
preempts a less urgent one holding the pages (on a 1P2D stack: on the other decode worker when nobody
worse runs on the one that refused it), is admitted past a backlog of less urgent prompts, and
answers exactly what it answers alone; a Triton gRPC client says it with Triton's priority levels, read on
the deployment's levels (`--priority-levels`, `--default-priority-level`). Without the policy a non-zero
priority is refused (tests/serve/test_prompt_options.py); the prefill queue's order is
tested on a real prefill worker (tests/workers/test_prefill_priority.py) and its policy (tests/policies),
the co-located one's in tests/engine/test_scheduler.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import signal
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from clients.bench.drivers import GrpcDriver
from ops.deployment import DeploymentError, load_deployment
from tests.conftest import start_serve, stop_serve
from tests.serve.clients import ensemble_inputs, grpc_stream, metric_total, pages_used, post

BODY = {"max_tokens": 96, "ignore_eos": True, "temperature": 0}
MIN_TOKENS = {"min_tokens": (np.array([[96]], dtype=np.int32), "INT32")}  # over gRPC: exactly 96 tokens


def _finished_order(backlog, urgent) -> tuple[list[str], str]:
    """Five backlog requests, then the urgent one once each of them is prefilled (one decodes, four wait
    for the batch, each ~96 steps). `backlog(name, on_event)` answers a request's text and calls
    `on_event(n)` at its n-th streamed event (the first is its first token, sampled by the prefill worker);
    `urgent()` answers the urgent request's text. Returns the names in the order they finished, and that text."""
    finished, lock, first_tokens = [], threading.Lock(), threading.Semaphore(0)

    def run(name: str, send) -> str:
        text = send()
        with lock:
            finished.append(name)
        return text

    def on_event(n: int) -> None:
        if n == 1:
            first_tokens.release()

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        lows = [pool.submit(run, f"low-{i}", functools.partial(backlog, f"low-{i}", on_event)) for i in range(5)]
        for _ in lows:
            assert first_tokens.acquire(timeout=120)
        text = pool.submit(run, "Urgent", urgent).result(timeout=300)
        for f in lows:
            f.result(timeout=300)
    return finished, text


def test_an_urgent_request_overtakes_a_backlog_waiting_for_the_decode_batch(built_engines, tmp_path):
    """The urgent request comes over Triton gRPC with Triton's priority level 1 (frontdoor/schedule_policy.py:
    Tandem's priority -2^31 + 1), the backlog over OpenAI's completions at the default priority, 0: only
    the level read as Triton means it puts it first."""
    s = start_serve(built_engines, tmp_path, "--scheduling-policy", "priority", "--max-num-seqs", "1")
    try:
        urgent_in = ensemble_inputs(grpcclient, "Urgent: name three rivers.", 96, False, MIN_TOKENS)
        client = grpcclient.InferenceServerClient(s.grpc)
        alone = client.infer("ensemble", urgent_in).as_numpy("text_output")[0][0].decode()
        levels = client.get_model_config("ensemble").config.dynamic_batching
        assert (levels.priority_levels, levels.default_priority_level) == (2**32 - 1, 2**31)
        code, err = post(s.http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                          "priority": 2**40})
        assert code == 400 and err["error"]["param"] == "priority" and "[-2147483647, 2147483647]" in \
            err["error"]["message"], err

        def openai_low(name: str, on_event) -> str:
            body = {**BODY, "prompt": f"{name}: name three rivers.", "priority": 0, "stream": True}
            code, events = post(s.http, "/v1/completions", body, on_event=on_event)
            assert code == 200, events
            return "".join(e["choices"][0]["text"] for e in events if e["choices"])

        finished, text = _finished_order(openai_low, lambda: client.infer("ensemble", urgent_in, priority=1)
                                         .as_numpy("text_output")[0][0].decode())
        assert text == alone  # a priority changes no token
        # first come, first served it would finish last; it waits for the one decoding when it came and at
        # most one that took the batch's place before its own K/V were in
        assert finished.index("Urgent") <= 2, finished
        client.close()
    finally:
        stop_serve(s)


def test_priority_levels_read_as_the_deployment_sets_them(built_engines, tmp_path):
    """`--priority-levels 3 --default-priority-level 2` (1 high, 2 normal, 3 low, as a Triton model's config
    may set them): a backlog at level 3 over Triton gRPC is overtaken by a request naming no priority (over
    OpenAI: 0, level 2). Read on the default levels (default 2^31), level 3 would go before everything."""
    s = start_serve(built_engines, tmp_path, "--scheduling-policy", "priority", "--max-num-seqs", "1",
                    "--priority-levels", "3", "--default-priority-level", "2")
    urgent = {**BODY, "prompt": "Urgent: name three rivers."}
    try:
        client = grpcclient.InferenceServerClient(s.grpc)
        levels = client.get_model_config("ensemble").config.dynamic_batching
        assert (levels.priority_levels, levels.default_priority_level) == (3, 2)
        with pytest.raises(InferenceServerException, match=r"priority must be an integer in \[0, 3\]") as e:
            client.infer("ensemble", ensemble_inputs(grpcclient, "Hi", 2, False), priority=4)
        assert "INVALID_ARGUMENT" in str(e.value.status())
        client.close()
        assert _bench_level(s.grpc, 1) == 3  # the bench's driver reads the default level from the config

        def grpc_low(name: str, on_event) -> str:
            return "".join(grpc_stream(s.grpc, f"{name}: name three rivers.", 96, MIN_TOKENS, priority=3,
                                       on_part=on_event))

        def openai_urgent() -> str:
            code, answer = post(s.http, "/v1/completions", urgent)
            assert code == 200, answer
            return answer["choices"][0]["text"]

        alone = openai_urgent()
        finished, text = _finished_order(grpc_low, openai_urgent)
        assert text == alone
        assert finished.index("Urgent") <= 2, finished
    finally:
        stop_serve(s)


def _bench_level(grpc_url: str, priority: int) -> int:
    async def level() -> int:
        driver = GrpcDriver(grpc_url)
        try:
            return await driver.level(priority)
        finally:
            await driver.close()
    return asyncio.run(level())


def test_an_urgent_request_takes_freed_pages_before_requests_waiting_longer(built_engines, tmp_path):
    """A 5-page decode pool (80 tokens): a holder more urgent than all (so nobody preempts it) takes 4 pages
    and waits for its prefill (the prefill worker stopped); four requests of 3 pages each, then an urgent
    one, are refused for pages and wait in the orchestrator. When the holder ends, one of them fits at a
    time: the urgent one goes first (first come, first served, its earlier neighbours would race it for the
    pages and most often win)."""
    cfg = tmp_path / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"health": {"stall_s": 60, "stall_restart_s": 120}}))  # the stop is no stall
    s = start_serve(built_engines, tmp_path, "--scheduling-policy", "priority", "--config", str(cfg),
                    "--kv-pool-bytes", str(5 * 16 * 46080))  # the default model: 46080 KV bytes per token
    body = {"max_tokens": 30, "ignore_eos": True, "temperature": 0}  # ~9 prompt tokens + 30: 3 pages
    try:
        alone = post(s.http, "/v1/completions", {**body, "prompt": "Urgent: name three rivers."})
        assert alone[0] == 200, alone
        finished, lock = [], threading.Lock()

        def send(name: str, priority: int, tokens: int = 30) -> str:
            code, answer = post(s.http, "/v1/completions", {**body, "prompt": f"{name}: name three rivers.",
                                                            "max_tokens": tokens, "priority": priority})
            assert code == 200, answer
            with lock:
                finished.append(name)
            return answer["choices"][0]["text"]

        prefill = s.workers()["prefill-0"]["pid"]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            os.killpg(prefill, signal.SIGSTOP)
            try:
                holder = pool.submit(send, "Holder", -9, 52)  # ~12 + 52 tokens: 4 pages, held until its prefill
                until = time.monotonic() + 30
                while sum(pages_used(s.http).values()) < 4 and time.monotonic() < until:
                    time.sleep(0.05)
                assert sum(pages_used(s.http).values()) >= 4
                lows = [pool.submit(send, f"low-{i}", 5) for i in range(4)]
                time.sleep(1.5)  # each tried once and was refused: 1 page is free, it needs 3
                urgent = pool.submit(send, "Urgent", -5)
                time.sleep(1.5)
            finally:
                os.killpg(prefill, signal.SIGCONT)
            assert urgent.result(timeout=300) == alone[1]["choices"][0]["text"]  # a priority changes no token
            for f in [holder, *lows]:
                f.result(timeout=300)
        assert finished[:2] == ["Holder", "Urgent"], finished
    finally:
        stop_serve(s)


def test_an_urgent_request_preempts_a_less_urgent_one_holding_the_pages(built_engines, tmp_path):
    """A 10-page decode pool (160 tokens): a request of priority 5, sampled at temperature 1 with a seed,
    streams a long answer and holds all 10 pages; an urgent one (-5, 3 pages) is refused for pages and
    preempts it (control/waiting_room.py). The urgent one finishes first; the preempted one resumes (its
    prompt and tokens so far prefilled again) and both answer exactly what they answer alone."""
    s = start_serve(built_engines, tmp_path, "--scheduling-policy", "priority",
                    "--kv-pool-bytes", str(10 * 16 * 46080))  # the default model: 46080 KV bytes per token
    holder = {"prompt": "Holder: tell a long story about rivers.", "max_tokens": 148, "ignore_eos": True,
              "temperature": 1.0, "seed": 7, "priority": 5}  # ~10 prompt tokens + 148: all 10 pages
    urgent = {"prompt": "Urgent: name three rivers.", "max_tokens": 30, "ignore_eos": True, "temperature": 0,
              "priority": -5}
    try:
        alone = [post(s.http, "/v1/completions", body)[1]["choices"][0]["text"] for body in (holder, urgent)]
        finished, lock, streaming = [], threading.Lock(), threading.Semaphore(0)

        def send(name: str, body: dict, on_event=None) -> str:
            code, answer = post(s.http, "/v1/completions", {**body, "stream": True}, on_event=on_event)
            assert code == 200, answer
            with lock:
                finished.append(name)
            return "".join(e["choices"][0]["text"] for e in answer if e["choices"])

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = pool.submit(send, "Holder", holder, lambda n: n == 10 and streaming.release())
            assert streaming.acquire(timeout=120)  # it decodes, 138 tokens to go
            assert pool.submit(send, "Urgent", urgent).result(timeout=300) == alone[1]
            assert held.result(timeout=300) == alone[0]  # resumed exactly: no token lost, repeated or changed
        assert finished == ["Urgent", "Holder"], finished
        assert metric_total(s.http, "tandem_preemptions_total") >= 1
    finally:
        stop_serve(s)


def test_an_urgent_request_refused_where_nobody_is_worse_preempts_on_the_other_decode_worker(built_engines, tmp_path):
    """1P2D, 20-page decode pools: Keeper (-9, 12 pages) runs on one decode worker, Holder (5, 16 pages,
    seeded temperature 1) on the other. Urgent (-5, 10 pages) fits on neither; the worker with the most
    free pages (Keeper's) refuses it and holds nobody worse, so the least urgent request elsewhere,
    Holder, is preempted (control/waiting_room.py make_room) and Urgent takes its pages. Urgent finishes
    before Holder and both answer as alone (without the fallback, Urgent waited ~175 tokens for Keeper)."""
    page = 16 * 46080  # the default model's KV bytes per 16-token page
    s = start_serve(built_engines, tmp_path, "--scheduling-policy", "priority", "--decode", "2",
                    "--kv-pool-bytes", str(20 * page))
    common = {"ignore_eos": True, "stream": True}
    keeper = {**common, "prompt": "Keeper: tell a story about lakes.", "max_tokens": 175, "temperature": 0,
              "priority": -9}
    holder = {**common, "prompt": "Holder: tell a long story about rivers.", "max_tokens": 236,
              "temperature": 1.0, "seed": 7, "priority": 5}
    urgent = {**common, "prompt": "Urgent: name three rivers.", "max_tokens": 142, "temperature": 0,
              "priority": -5}
    finished, lock = [], threading.Lock()

    def send(name: str, body: dict, on_event=None) -> str:
        code, answer = post(s.http, "/v1/completions", {**body, "stream_options": {"include_usage": True}},
                            on_event=on_event)
        assert code == 200, answer
        with lock:
            finished.append(name)
        pages = -(-answer[-1]["usage"]["total_tokens"] // 16)
        assert pages == {"Keeper": 12, "Holder": 16, "Urgent": 10}[name], (name, answer[-1]["usage"])
        return "".join(e["choices"][0]["text"] for e in answer if e["choices"])

    try:
        alone = {name: send(name, body) for name, body in (("Holder", holder), ("Urgent", urgent))}
        finished.clear()
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = {}
            for name, body in (("Keeper", keeper), ("Holder", holder)):  # Holder fits only the other worker
                streaming = threading.Semaphore(0)
                futures[name] = pool.submit(send, name, body, lambda n, go=streaming: n == 10 and go.release())
                assert streaming.acquire(timeout=120)
            assert pool.submit(send, "Urgent", urgent).result(timeout=300) == alone["Urgent"]
            assert futures["Holder"].result(timeout=300) == alone["Holder"]  # resumed exactly
            futures["Keeper"].result(timeout=300)
        assert finished.index("Urgent") < finished.index("Holder"), finished
        assert metric_total(s.http, "tandem_preemptions_total") >= 1
    finally:
        stop_serve(s)


def test_an_urgent_request_is_admitted_past_a_full_backlog_of_less_urgent_prompts(built_engines, tmp_path):
    """limits.max_queued_tokens 40 and the prefill worker stopped, so admitted prompts stay queued:
    requests of priority 5 fill the backlog until one is refused (429). One of priority -5 is admitted all
    the same (control/admission.py: the workers take it before that backlog) and answers as it does alone
    once the worker goes on; the admitted backlog loses nothing."""
    cfg = tmp_path / "dep.yaml"
    cfg.write_text(yaml.safe_dump({"health": {"stall_s": 60, "stall_restart_s": 120},  # the stop is no stall
                                   "limits": {"max_queued_tokens": 40}}))
    s = start_serve(built_engines, tmp_path, "--scheduling-policy", "priority", "--config", str(cfg))
    body = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}

    def send(name: str, priority: int) -> tuple[int, dict]:
        return post(s.http, "/v1/completions", {**body, "prompt": f"{name}: name three rivers.", "priority": priority})
    try:
        code, alone = send("Urgent", 0)
        assert code == 200, alone
        prefill = s.workers()["prefill-0"]["pid"]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            os.killpg(prefill, signal.SIGSTOP)
            try:
                admitted, refused = [], None
                while refused is None and len(admitted) < 10:  # ~9 prompt tokens each: the 5th is over 40
                    low = pool.submit(send, f"low-{len(admitted)}", 5)
                    time.sleep(1.0)  # refused at once, or admitted and waiting for the stopped prefill
                    if low.done():
                        refused = low.result()
                    else:
                        admitted.append(low)
                assert refused is not None and refused[0] == 429, (len(admitted), refused)
                assert "prompt tokens are queued (limit 40)" in refused[1]["error"]["message"], refused
                urgent = pool.submit(send, "Urgent", -5)
                time.sleep(1.0)
                assert not urgent.done(), urgent.result()  # admitted: it waits for the prefill worker too
            finally:
                os.killpg(prefill, signal.SIGCONT)
            code, answer = urgent.result(timeout=120)
            assert code == 200 and answer["choices"][0]["text"] == alone["choices"][0]["text"], answer
            assert all(f.result(timeout=120)[0] == 200 for f in admitted)
    finally:
        stop_serve(s)


def test_tensorrt_llm_roles_refuse_the_priority_policy():
    with pytest.raises(DeploymentError, match="schedule their requests themselves"):
        load_deployment(None, {"backend": "tensorrt-llm", "device": "cuda", "scheduling_policy": "priority"})


@pytest.mark.parametrize("overrides, why", [
    ({"priority_levels": 3, "default_priority_level": 2}, "but scheduling_policy is fcfs"),
    ({"scheduling_policy": "priority", "priority_levels": 3}, "together"),
    ({"scheduling_policy": "priority", "priority_levels": 3, "default_priority_level": 4},
     r"default level in \[1, N\]"),
    ({"scheduling_policy": "priority", "priority_levels": 2**32, "default_priority_level": 1}, "N in"),
    ({"scheduling_policy": "priority", "priority_levels": 2**31 + 1, "default_priority_level": 1},
     "at most 2147483647 levels above"),
    ({"scheduling_policy": "priority", "priority_levels": 2**32 - 1, "default_priority_level": 2**31 + 1},
     "default level at most 2147483648"),
])
def test_priority_levels_that_cannot_be_read_are_refused_naming_why(overrides, why):
    with pytest.raises(DeploymentError, match=why):
        load_deployment(None, overrides)


def test_a_level_is_the_priority_its_distance_from_the_default():
    three = load_deployment(None, {"scheduling_policy": "priority", "priority_levels": 3,
                                   "default_priority_level": 2}).levels
    assert [three.priority(k) for k in (0, 1, 2, 3)] == [0, -1, 0, 1] and three.level(1) == 3
    full = load_deployment(None, {"scheduling_policy": "priority"}).levels  # every Tandem priority, 0 in the middle
    assert (full.priority(1), full.priority(2**32 - 1), full.level(0)) == (-(2**31 - 1), 2**31 - 1, 2**31)
