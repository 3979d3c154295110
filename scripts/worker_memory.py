#!/usr/bin/env python3
"""Memory each worker's Triton server keeps per request served: start `tandem serve`, send `--warmup`
short completions, read every tritonserver's private resident memory (RssAnon in /proc/<pid>/status:
not the shared KV pools, not the model files), send `--requests` more, read it again, and print per
server what it kept per request. A server that keeps nothing grows by ~0 bytes per request once warm.
`--max-tokens` sets the measured requests' length (a decode worker sends one response per token). With
`--every N` it also reads every N requests (`readings`): a server whose growth flattens fills a pool
it reuses (Triton keeps finished requests' states, docs/operations.md), one that grows in steady steps
keeps something per request.

Standard library only, so it measures any checkout (`--python`, `--cwd`, `--module` as for
scripts/idle_cpu.py); arguments after `--` go to `tandem serve`.

    python scripts/worker_memory.py [--requests 600] [--warmup 100] [--every 1000] -- --model engines/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

from idle_cpu import add_serve_args, served, tree


def anon_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def tritonservers(root: int) -> dict[str, int]:
    """The model each tritonserver under `root` serves (--load-model) -> its pid."""
    out = {}
    for pid in tree(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and argv[0].endswith("tritonserver"):
            model = next((a.split("=", 1)[1] for a in argv if a.startswith("--load-model=")), "?")
            out[f"{model} (pid {pid})"] = pid
    return out


def complete(http: int, i: int, max_tokens: int = 4) -> None:
    """One completion of exactly `max_tokens` tokens (ignore_eos)."""
    body = json.dumps({"model": "smollm2-135m", "prompt": f"Request {i}: the number after {i} is",
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens per measured request (the warm-up's: 4)")
    ap.add_argument("--every", type=int, default=0, help="also read the servers every N requests (0: only at the end)")
    add_serve_args(ap)
    args = ap.parse_args()
    with served(args) as (proc, http):
        for i in range(args.warmup):
            complete(http, i)
        servers = tritonservers(proc.pid)

        def read() -> dict[str, int]:
            return {name: anon_kb(pid) for name, pid in servers.items()}

        before, t0, readings = read(), time.monotonic(), []
        for n in range(1, args.requests + 1):
            complete(http, args.warmup + n, args.max_tokens)
            if args.every and n % args.every == 0 and n < args.requests:
                readings.append([n, read()])
        after = read()
        print(json.dumps({"requests": args.requests, "seconds": round(time.monotonic() - t0, 1), "servers": {
            name: {"rss_anon_kb": [before[name], after[name]],
                   "bytes_per_request": round((after[name] - before[name]) * 1024 / args.requests)}
            for name in servers}, **({"readings": readings} if readings else {})}, indent=1))


if __name__ == "__main__":
    main()
