"""The Compose stack end to end (run by scripts/compose-test; needs Docker and docker-compose, ~10 minutes).

1. build the image (deploy/build-image, on the local Debian base) and time it;
2. the engine's CPU kernels load in the image, which has no C++ compiler (built in a stage of their own);
3. NIXL between two containers on a network like the stack's: the project's transport writes a
   prompt's KV pages from one container into a pool in the other (UCX over TCP on eth0);
4. bring the stack up (orchestrator, prefill, decode) and wait for every health check;
5. a streamed greedy chat answer must equal `tandem generate --json` on the host, text for text;
6. crash the decode container mid-stream: the stream must complete exactly (resumed on a fresh pair)
   or end retryably (HTTP 503 + Retry-After, or an SSE error event naming UNAVAILABLE); the container
   must restart and the stack be healthy again;
7. `down -v --remove-orphans`; nothing of the project may remain (containers, networks, volumes, the
   secret, the image it superseded, /dev/shm entries it made).
Prints one summary; exits non-zero when a step failed, naming it with a log excerpt.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import time

from tests.deploy.compose_stack import Stack, sh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "Explain in a few sentences why the sky is blue."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(prompt: str, max_tokens: int) -> str:
    """The greedy answer of one in-process engine on the host."""
    out = sh([os.path.join(ROOT, ".venv", "bin", "tandem"), "generate", "--prompt", prompt, "--max-tokens",
              str(max_tokens), "--temperature", "0", "--json"], timeout=900)
    return json.loads(out.strip().splitlines()[-1])["text"]


def stream_chat(port: int, prompt: str, max_tokens: int, on_delta=None) -> dict:
    """POST a streamed greedy chat completion; returns {status, retry_after, text, error, done}.
    on_delta(n) is called after the n-th text delta (the crash hook)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "temperature": 0,
            "max_tokens": max_tokens}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = {"status": resp.status, "retry_after": resp.getheader("Retry-After"), "text": "", "error": None,
           "done": False}
    if resp.status != 200:
        out["error"] = resp.read().decode(errors="replace")[:300]
        return out
    n = 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            out["done"] = True
            break
        event = json.loads(data)
        if "error" in event:
            out["error"] = event
            continue
        delta = event["choices"][0]["delta"].get("content") if event["choices"] else None
        if delta:
            out["text"] += delta
            n += 1
            if on_delta:
                on_delta(n)
    conn.close()
    return out


def kernels_in_image(image: str) -> str:
    """The image's engine loads Tandem's CPU kernels without a compiler (on a host CPU with AVX-512 or AVX2:
    the image holds both builds)."""
    flags = open("/proc/cpuinfo").read()
    if "avx512f" not in flags and "avx2" not in flags:
        return "skipped: this CPU has neither AVX-512 nor AVX2 (the engine uses PyTorch's kernels)"
    said = sh(["docker", "run", "--rm", image, "sh", "-c",
               "for c in cc c++ gcc g++; do command -v $c >/dev/null "
               "&& { echo \"a compiler is in the image: $c\" >&2; exit 1; }; done; "
               "python -m engine.cpu_kernels.build"]).strip()
    if not said.startswith("CPU kernels") or "not in use" in said:
        raise RuntimeError(f"the image's engine does not use the CPU kernels: {said!r}")
    return said


def nixl_between_containers(image: str) -> str:
    """Run tests/multihost/nixl_peer.py's pool and writer in two containers on a temporary network."""
    net = f"tandem-ct-kv-{os.getpid()}"
    sh(["docker", "network", "create", "--subnet", "198.18.252.0/24", net])
    ucx = ["-e", "UCX_TLS=tcp,self", "-e", "UCX_NET_DEVICES=eth0", "-e", "UCX_TCP_PORT_RANGE=20000-20099"]
    run = ["docker", "run", "--rm", "-i", "--network", net, *ucx, image, "python", "tests/multihost/nixl_peer.py"]
    pool = subprocess.Popen([*run, "pool"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    writer = None
    try:
        nixl = json.loads(pool.stdout.readline())["nixl"]
        job = {"nixl": nixl, "request_id": "ct", "pages": list(range(250)), "seed": 3, "tokens": 4000}
        writer = subprocess.Popen([*run, "write"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        writer.stdin.write(json.dumps(job) + "\n")
        writer.stdin.flush()
        sent = json.loads(writer.stdout.readline())
        pool.stdin.write(json.dumps({"cmd": "wait", **{k: job[k] for k in ("request_id", "pages", "seed", "tokens")}})
                         + "\n")
        pool.stdin.flush()
        arrived = json.loads(pool.stdout.readline())
        if arrived != {"ready": True, "exact": True}:
            raise RuntimeError(f"KV pages did not land exactly across containers: {arrived}")
        return f"{sent['bytes'] / 2**20:.0f} MiB in {sent['seconds']:.2f} s ({sent['bytes'] / sent['seconds'] / 1e9:.2f} GB/s)"
    finally:
        for proc in (writer, pool):
            if proc is not None and proc.poll() is None:
                proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=60)
        sh(["docker", "network", "rm", net], check=False)


def crash_mid_stream(stack: Stack, expected: str, max_tokens: int) -> str:
    """Crash decode after a few deltas; classify the stream's end; wait for the restart and health."""
    before = {}

    def hook(n: int) -> None:
        if n == 5 and not before:
            before["restarts"] = stack.crash("decode")

    got = stream_chat(stack.http_port, PROMPT, max_tokens, hook)
    if not before:
        raise RuntimeError(f"the stream ended before the crash point: {got}")
    if got["done"] and got["error"] is None:
        if got["text"] != expected:
            raise RuntimeError(f"resumed stream differs from the reference:\n  got {got['text']!r}\n  want {expected!r}")
        outcome = "resumed: completed exactly"
    elif got["status"] == 503 and got["retry_after"]:
        outcome = f"retryable refusal: HTTP 503, Retry-After {got['retry_after']}"
    elif got["error"] is not None and "UNAVAILABLE" in json.dumps(got["error"]):
        outcome = f"retryable SSE error after {len(got['text'])} chars: {json.dumps(got['error'])[:160]}"
    else:
        raise RuntimeError(f"stream neither resumed nor ended retryably: {got}")
    deadline = time.monotonic() + 300
    while stack.state("decode")["RestartCount"] <= before["restarts"]:
        if time.monotonic() > deadline:
            raise RuntimeError("decode was not restarted after its crash")
        time.sleep(1)
    stack.wait_healthy(["prefill", "decode", "orchestrator"], timeout=600)
    return outcome + "; decode restarted, stack healthy again"


def build(image: str, base: str) -> tuple[str, str]:
    """Build the image (deploy/build-image drops the build it superseded); (seconds, size)."""
    start = time.monotonic()
    subprocess.run([os.path.join(ROOT, "deploy", "build-image"), "--base", base, "--tag", image], check=True,
                   stdout=subprocess.DEVNULL)
    seconds = time.monotonic() - start
    size = int(sh(["docker", "image", "inspect", image, "--format", "{{.Size}}"]))
    return f"{seconds:.0f} s", f"{size / 2**30:.2f} GiB"


class Run:
    """Steps in order; the first failure stops the rest (teardown always runs) and is reported."""

    def __init__(self):
        self.summary: list[tuple[str, str]] = []
        self.failed = False

    def step(self, name: str, fn, *args):
        if self.failed:
            self.summary.append((name, "not run (an earlier step failed)"))
            return None
        t = time.monotonic()
        try:
            result = fn(*args)
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
            self.failed = True
            self.summary.append((name, f"FAILED: {e}"))
            return None
        shown = result if isinstance(result, str) else "ok"
        self.summary.append((name, f"{shown} [{time.monotonic() - t:.0f} s]"))
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description="Build, run and break the Compose stack; report.")
    parser.add_argument("--image", default="tandem-cpu:latest")
    parser.add_argument("--base", default="tandem-base:bookworm")
    parser.add_argument("--skip-build", action="store_true", help="use the existing image")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    shm_before = set(os.listdir("/dev/shm"))
    run = Run()
    if not args.skip_build:
        built = run.step("build image", build, args.image, args.base)
        if built:
            run.summary[-1] = ("build image", f"{args.image}: {built[0]}, {built[1]}")
    run.step("CPU kernels in the image (no compiler there)", kernels_in_image, args.image)
    run.step("NIXL between two containers", nixl_between_containers, args.image)
    expected = run.step("reference answer on the host (tandem generate --json)", reference, PROMPT, args.max_tokens)
    stack = Stack(os.path.join(ROOT, "deploy", "docker-compose.cpu.yml"), args.image, free_port(), free_port())
    try:
        run.step("compose up", stack.up)
        run.step("all services healthy", stack.start_front, 900)
        got = run.step("streamed greedy answer", stream_chat, stack.http_port, PROMPT, args.max_tokens)
        if got is not None:
            exact = got["done"] and got["error"] is None and got["text"] == expected
            run.summary[-1] = ("streamed greedy answer", f"{'equals' if exact else 'DIFFERS FROM'} the host's: "
                               f"{got['text'][:70]!r}...")
            if not exact:
                run.failed = True
                run.summary.append(("  detail", f"got {got}, want {expected!r}"))
        run.step("decode crashed mid-stream", crash_mid_stream, stack, expected, args.max_tokens)
    finally:
        stack.down()
    left = stack.leftovers()
    run.summary.append(("down -v --remove-orphans", "nothing left" if not left else f"LEFT: {left}"))
    new_shm = sorted(set(os.listdir("/dev/shm")) - shm_before)
    run.summary.append(("/dev/shm", "no new entries" if not new_shm else f"new entries (maybe others'): {new_shm}"))
    print(f"\ncompose-test, project {stack.project}:")
    for name, what in run.summary:
        print(f"  {name}: {what}")
    return 1 if run.failed or left else 0


if __name__ == "__main__":
    sys.exit(main())
