"""Test "hosts" made of Linux network namespaces on one machine, joined by a bridge.

    with hosts(2) as (a, b):            # or the `netns_hosts` fixture (tests/multihost/conftest.py)
        proc = a.popen(["python3", "-m", "http.server", "--bind", a.address, "8080"])
        b.run(["curl", f"http://{a.address}:8080/"])

Each host is a namespace `tandem-h<i>-<tag>` with `lo` up and one end of a veth pair; the other ends
sit on a bridge in the root namespace. The bridge holds 198.18.<k>.1/24 and host i holds
198.18.<k>.<i+2>/24 (198.18.0.0/15 is reserved for benchmarking networks: it never collides with a
real network, and no other range is used). <k> is a /24 that no interface of this machine uses yet.
Processes see separate network stacks (ports, addresses, routes) but share the filesystem and /dev/shm.

Teardown -- on normal exit and after any failure -- kills every process started through `popen`
(whole process groups), deletes the namespaces, their veths, the bridge and the one iptables rule
that lets frames cross it (Docker's FORWARD policy drops bridged traffic otherwise). Needs root and `ip`;
`unavailable()` says why not, for a pytest skip.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

PREFIX = "198.18"  # the only range these hosts use (RFC 2544 benchmarking addresses)
MAX_HOSTS = 200


def unavailable() -> str | None:
    """Why namespaces cannot be made here (for pytest.skip), or None when they can."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns add)"
    if shutil.which("ip") is None:
        return "network-namespace hosts need the `ip` tool (apt-get install iproute2)"
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def _used_subnets() -> set[int]:
    """Third octets k of every 198.18.k.x address or route this machine has now."""
    out = subprocess.run(["ip", "-4", "-o", "route", "show", "table", "all"], capture_output=True,
                         text=True).stdout
    out += subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    used = set()
    for word in out.split():
        parts = word.split("/")[0].split(".")
        if len(parts) == 4 and ".".join(parts[:2]) == PREFIX and parts[2].isdigit():
            used.add(int(parts[2]))
    return used


def _free_subnet() -> int:
    """A /24 inside 198.18.0.0/16 that nothing here uses (docker's pools are kept out of 198.18 too)."""
    used = _used_subnets()
    candidates = [k for k in range(10, 250) if k not in used]
    if not candidates:
        raise RuntimeError(f"every {PREFIX}.k.0/24 with 10 <= k < 250 is in use")
    return candidates[secrets.randbelow(len(candidates))]


@dataclass
class Host:
    """One namespace: its name, its veth inside it, and its address on the bridge."""

    name: str
    device: str  # the veth end inside the namespace (UCX_NET_DEVICES for UCX there)
    address: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: list[str], timeout: float = 60.0, **kw) -> subprocess.CompletedProcess:
        """Run argv inside this host to completion (text output captured unless told otherwise)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(argv), timeout=timeout, **kw)

    def popen(self, argv: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start argv inside this host in its own process group; teardown kills it if still alive.
        `env` entries are added to this process's environment."""
        full = dict(os.environ, **(env or {}))
        proc = subprocess.Popen(self.argv(argv), env=full, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.procs.clear()


@dataclass
class Network:
    """The bridge and the hosts on it; `teardown` removes everything `create` made, whatever got made."""

    tag: str
    subnet: int
    hosts: list[Host] = field(default_factory=list)
    made: list[tuple[str, str]] = field(default_factory=list)  # (netns|link|iptables, what), in creation order

    @property
    def bridge(self) -> str:
        return f"tbr-{self.tag}"  # <= 15 characters (IFNAMSIZ)

    @property
    def gateway(self) -> str:
        return f"{PREFIX}.{self.subnet}.1"

    def create(self, n: int) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self._allow_forwarding()
        for i in range(n):
            self.hosts.append(self._add_host(i))

    def _allow_forwarding(self) -> None:
        """Let frames cross our bridge. With br_netfilter loaded (Docker loads it) bridged frames pass
        the root namespace's iptables FORWARD chain, whose policy Docker sets to DROP."""
        if shutil.which("iptables") is None:
            return
        rule = ("FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT")
        proc = subprocess.run(["iptables", "-I", *rule], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"iptables -I {' '.join(rule)} failed: {proc.stderr.strip()}")
        self.made.append(("iptables", " ".join(rule)))

    def _add_host(self, i: int) -> Host:
        ns, outer, inner = f"tandem-h{i}-{self.tag}", f"tv{i}-{self.tag}", f"th{i}-{self.tag}"
        _ip("netns", "add", ns)
        self.made.append(("netns", ns))
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self.made.append(("link", outer))  # deleting one end deletes its peer
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("link", "set", inner, "netns", ns)
        address = f"{PREFIX}.{self.subnet}.{i + 2}"
        for args in (("addr", "add", f"{address}/24", "dev", inner), ("link", "set", inner, "up"),
                     ("link", "set", "lo", "up")):
            _ip("-n", ns, *args)
        return Host(ns, inner, address)

    def teardown(self) -> list[str]:
        """Kill our processes, then delete namespaces and links (newest first); return what failed."""
        for host in self.hosts:
            host.kill_all()
        errors = []
        for kind, name in reversed(self.made):
            if kind == "iptables":
                argv = ["iptables", "-D", *name.split()]
            else:
                argv = ["ip", "netns", "delete", name] if kind == "netns" else ["ip", "link", "delete", name]
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0 and "Cannot find" not in proc.stderr and "No such" not in proc.stderr:
                errors.append(f"{' '.join(argv)}: {proc.stderr.strip()}")
        self.made.clear()
        return errors


def leftovers(tag: str) -> list[str]:
    """Namespaces, links and iptables rules of network `tag` that still exist (for tests of teardown)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [n for n in names if n.endswith(f"-{tag}")]
    words = [w.rstrip(":").split("@")[0] for w in links.split()]
    found += [w for w in words if w.endswith(f"-{tag}")]
    if shutil.which("iptables"):
        rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
        found += [r for r in rules.splitlines() if f"tbr-{tag}" in r]
    return found


@contextlib.contextmanager
def hosts(n: int):
    """n hosts on one fresh bridge; everything is removed on exit, also after a failure."""
    if not 1 <= n <= MAX_HOSTS:
        raise ValueError(f"hosts(n): n must be between 1 and {MAX_HOSTS}, got {n}")
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    net = Network(tag=secrets.token_hex(3), subnet=_free_subnet())
    try:
        net.create(n)
        yield net.hosts
    finally:
        errors = net.teardown()  # runs on every exit; a failure in flight is not masked below
    if errors:
        raise RuntimeError("network-namespace teardown left things behind: " + "; ".join(errors))
