#!/usr/bin/env python3
"""KV handoff across a network link: NIXL (UCX over TCP) between two hosts vs a plain TCP stream of the
same bytes over the same link, and TTFT with vs without the handoff, in one run.

The two hosts are network namespaces on this machine joined by a bridge (tests/multihost/netns.py,
addresses in 198.18.0.0/15); the decode-side pool runs in one, the prefill side (this benchmark's
writer and a real prefill pass of the default model) in the other. Needs root.

    python scripts/bench_multihost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.multihost import netns  # noqa: E402
from tests.multihost.link import tcp_throughput  # noqa: E402
from tests.multihost.test_nixl_hosts import ucx_env  # noqa: E402

KV_BYTES_PER_TOKEN = 46080  # the default model: 30 layers x 2 (k, v) x 3 KV heads x 64 dims x 4 bytes
LENGTHS = (512, 4096)


def env_prefix(env: dict[str, str]) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    why = netns.unavailable()
    if why:
        sys.exit(f"cannot make test hosts: {why}")
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_handoff.py")
    with netns.hosts(2) as (decode, prefill):
        print(f"decode host {decode.address}, prefill host {prefill.address} (network namespaces on a bridge)")
        for n in LENGTHS:
            nbytes = n * KV_BYTES_PER_TOKEN
            runs = [tcp_throughput(decode, prefill, nbytes).gbps for _ in range(args.repeats)]
            print(f"plain TCP stream, {n:>5} tokens' KV ({nbytes / 1e6:.1f} MB): {max(runs):.2f} GB/s (best of "
                  f"{args.repeats})")
        wrap = decode.argv(env_prefix(ucx_env(decode)))
        proc = prefill.popen([sys.executable, bench, "--transports", "nixl", "--threads", "1", "--repeats",
                              str(args.repeats), "--pool-wrap", shlex.join(wrap)], env=ucx_env(prefill))
        code = proc.wait(timeout=1800)
        if code != 0:
            sys.exit(f"bench_handoff.py across the hosts failed with {code}")


if __name__ == "__main__":
    main()
