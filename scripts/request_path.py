"""The path of one streamed disaggregated request through the orchestrator, measured on a real stack.

Starts a 1P1D stack in this process (two real Triton workers, the real front doors), sends one warm-up
request, then traces one streamed request of `--tokens` tokens with sys.setprofile (and
threading.setprofile for the tokenizer's threads). It prints, for the orchestrator process:

- every project function the request passed through, as `file:function` lines in order of first call;
- the files with logic on that path (project files with at least one function called);
- the async-generator layers per token: project async generators resumed at least once per token
  (a generator chain resumes each of its layers once per item it passes up).

The workers run in their own processes and are not traced here. `--root` measures another checkout
(e.g. `git archive 2ceb893 | tar -x -C /tmp/before`, then `--root /tmp/before`): its code is imported
instead of this one's. Usage:

    python scripts/request_path.py --protocol openai|grpc [--root DIR] [--engines DIR] [--tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import queue
import socket
import sys
import tempfile
import threading
import urllib.request
from collections import Counter

PROMPT = "The three primary colours are"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tracer:
    """Counts calls (and generator resumptions) of the project's functions, in order of first call.

    Calls in tasks that were already running when tracing began (`shared`: the channels' reader tasks,
    which hand every worker reply to its call, and the fleet's stats watches) are counted apart from
    the request's own tasks, threads and event-loop callbacks."""

    def __init__(self, root: str, shared: set):
        self.root = os.path.realpath(root) + os.sep
        skip = (os.sep + ".venv" + os.sep, os.sep + "scripts" + os.sep, os.sep + "tests" + os.sep)
        self.skip = tuple(self.root.rstrip(os.sep) + s for s in skip)
        self.shared_tasks = shared
        self.calls: Counter = Counter()  # the request's own
        self.shared: Counter = Counter()  # in tasks that were already running
        self.asyncgen: set = set()
        self.lock = threading.Lock()

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(self.root) or path.startswith(self.skip):
            return
        key = (os.path.relpath(path, self.root), frame.f_code.co_qualname)
        loop = asyncio._get_running_loop()
        task = asyncio.current_task(loop) if loop is not None else None
        with self.lock:
            (self.shared if task in self.shared_tasks else self.calls)[key] += 1  # first-insertion order
            if frame.f_code.co_flags & inspect.CO_ASYNC_GENERATOR:
                self.asyncgen.add(key)


def openai_stream(http: str, tokens: int) -> int:
    body = {"prompt": PROMPT, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0, "stream": True}
    req = urllib.request.Request(http + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return sum(1 for line in r if line.startswith(b"data: {"))


def grpc_stream(url: str, tokens: int) -> int:
    import numpy as np
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, arr, dt in (("text_input", np.array([[PROMPT.encode()]], dtype=np.object_), "BYTES"),
                          ("max_tokens", np.array([[tokens]], dtype=np.int32), "INT32"),
                          ("min_tokens", np.array([[tokens]], dtype=np.int32), "INT32"),
                          ("stream", np.array([[True]]), "BOOL")):
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    c = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        c.async_stream_infer("ensemble", inputs, request_id="traced", enable_empty_final_response=True)
        n = 0
        while True:
            result, error = q.get(timeout=300)
            if error is not None:
                raise error
            n += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                return n
    finally:
        c.stop_stream()
        c.close()


async def measure(args) -> tuple[Tracer, int]:
    from concurrent.futures import ThreadPoolExecutor

    from ops.deployment import Deployment
    from ops.stack import Stack

    grpc_port, http_port = free_port(), free_port()
    dep = Deployment(model="smollm2-135m", engines=args.engines, kv_pool_bytes=256 << 20,
                     front_door={"grpc_port": grpc_port, "http_port": http_port})
    stack = Stack(dep, tempfile.mkdtemp(prefix="tandem-path-"), log=lambda m: print(m, file=sys.stderr))
    await stack.start()
    loop = asyncio.get_running_loop()
    send = (lambda n: openai_stream(f"http://127.0.0.1:{http_port}", n)) if args.protocol == "openai" else \
        (lambda n: grpc_stream(f"127.0.0.1:{grpc_port}", n))
    try:
        await loop.run_in_executor(None, send, 4)  # warm-up: connections, caches, lazy imports
        tracer = Tracer(args.root, asyncio.all_tasks())
        threading.setprofile(tracer)
        stack.service._pool = ThreadPoolExecutor(2, thread_name_prefix="prepare")  # new threads: profiled too
        sys.setprofile(tracer)
        try:
            responses = await loop.run_in_executor(None, send, args.tokens)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    finally:
        await stack.stop()
    return tracer, responses


def report(tracer: Tracer, tokens: int, responses: int, protocol: str, root: str) -> None:
    files = sorted({f for f, _ in tracer.calls})
    shared_files = sorted({f for f, _ in tracer.shared} - set(files))
    per_token = [k for k in tracer.calls if k in tracer.asyncgen and tracer.calls[k] >= tokens]
    print(f"# one streamed disaggregated request, {protocol}, {tokens} tokens ({responses} responses), root {root}")
    print(f"## path: the request's tasks, threads and callbacks ({len(tracer.calls)} functions, in order of "
          f"first call; calls in brackets)")
    for (f, fn), n in tracer.calls.items():
        print(f"{f}:{fn} [{n}]{'  async generator' if (f, fn) in tracer.asyncgen else ''}")
    print(f"## meanwhile in tasks already running (channel readers, fleet watches): {len(tracer.shared)} functions")
    for (f, fn), n in tracer.shared.items():
        print(f"{f}:{fn} [{n}]")
    print(f"## files with logic on the orchestrator side: {len(files)} on the request's path "
          f"(+{len(shared_files)} only in tasks already running)")
    for f in files:
        print(f"  {f}")
    for f in shared_files:
        print(f"  ({f})")
    print(f"## async-generator layers per token: {len(per_token)}")
    for f, fn in per_token:
        print(f"  {f}:{fn} [{tracer.calls[(f, fn)]}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--protocol", choices=("openai", "grpc"), default="openai")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="the checkout to measure (default: this one)")
    ap.add_argument("--engines", default=None, help="engines folder (default: build/use engines/smollm2-135m)")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    args.root = os.path.realpath(args.root)
    if args.engines:
        args.engines = os.path.abspath(args.engines)
    sys.path.insert(0, args.root)
    os.chdir(args.root)
    tracer, responses = asyncio.run(measure(args))
    report(tracer, args.tokens, responses, args.protocol, args.root)


if __name__ == "__main__":
    main()
