"""Two or three real "nodes" on one Linux machine: network namespaces on a bridge.

Multi-node promises (listeners bound to the interface that reaches
``--rdzv-endpoint``, a lost node named, a cut link stopping both sides) cannot be
checked with every "node" on 127.0.0.1: there a socket bound to the wrong interface,
or a worker that reaches its peer through loopback, looks fine. Here each node is a
network namespace with only ``lo`` and one veth, ``eth0``, holding an address of
its own; the veths meet on a bridge inside one more namespace (the "switch"), so
nothing is added to the machine's own network and traffic goes only to addresses
assigned here.

    with netns.cluster(nodes=2) as c:
        node0, node1 = c.nodes
        subprocess.run(node1.command(["python", "-c", "..."]), ...)   # "on" node 1
        node1.link(up=False)                                         # cut its cable

[Note: netns lifetime]
Everything is named ``PREFIX-<creating pid>-<n>...``. The context manager kills every
process still inside its namespaces and deletes them (the veths and the bridge go with
them) however the block ends; a run that was killed outright (SIGKILL of pytest,
a power cut) leaves namespaces whose creating pid is dead, which ``remove_stale``
deletes on the next run. Names resolve inside a node through
``/etc/netns/NAME/hosts`` (``ip netns exec`` mounts it over ``/etc/hosts``), so a
SLURM-style host list works; that directory is removed with the namespace.

Needs root and iproute2's ``ip``; ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "fsdpk"
"""Every namespace this module creates is named ``PREFIX-<pid>-...``."""
SUBNET = "10.213"
"""Addresses come from ``10.213.<k>.0/24`` (private, and used for nothing else here)."""
IP_TIMEOUT_S = 20.0
ETC_NETNS = Path("/etc/netns")
_counter = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message has its stderr."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if check and result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, ``ip netns add``
    refused), or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (CI runs these tests as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _ip("netns", "add", name)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed here: {exc}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass(frozen=True)
class Node:
    """One namespace: ``lo`` and ``eth0`` with ``address``, host name ``host``."""

    index: int
    netns: str
    address: str
    host: str
    iface: str = "eth0"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node (``ip netns exec``, which execs it: the pid a
        ``Popen`` of this gets is the command's own)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        """Processes whose network namespace is this node's."""
        out = _ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def link(self, *, up: bool) -> None:
        """Plug (``up``) or pull this node's cable: ``ip link set eth0 up|down``."""
        _ip("-n", self.netns, "link", "set", self.iface, "up" if up else "down")

    def drop_route(self) -> None:
        """Remove the route to the cluster's subnet: every peer becomes unreachable
        from this node (what a firewall rule or a wrong network looks like)."""
        _ip("-n", self.netns, "route", "flush", "dev", self.iface)

    def tcp_table(self) -> str:
        """``/proc/net/tcp`` and ``tcp6`` as seen inside this node."""
        result = subprocess.run(
            self.command(["cat", "/proc/net/tcp", "/proc/net/tcp6"]),
            capture_output=True,
            text=True,
            timeout=IP_TIMEOUT_S,
            check=False,
        )
        return result.stdout


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    switch: str
    """The namespace holding the bridge."""

    @property
    def names(self) -> list[str]:
        return [n.netns for n in self.nodes] + [self.switch]

    def hostlist(self) -> str:
        """The nodes as a SLURM host list: ``fsdpk-node[0-1]``."""
        return f"{PREFIX}-node[0-{len(self.nodes) - 1}]"

    def kill_all(self, *, grace_s: float = 5.0) -> list[int]:
        """SIGKILL every process inside the nodes, waiting up to ``grace_s`` for them
        to go; the pids that were found."""
        found = [pid for node in self.nodes for pid in node.pids()]
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + grace_s
        while any(n.pids() for n in self.nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
        return found


def _wire(node: Node, *, switch: str, prefix_len: int) -> None:
    port = f"p{node.index}"
    _ip("link", "add", node.iface, "netns", node.netns, "type", "veth", "peer", "name", port,
        "netns", switch)  # fmt: skip
    _ip("-n", switch, "link", "set", port, "master", "br0")
    _ip("-n", switch, "link", "set", port, "up")
    _ip("-n", node.netns, "addr", "add", f"{node.address}/{prefix_len}", "dev", node.iface)
    _ip("-n", node.netns, "link", "set", node.iface, "up")
    _ip("-n", node.netns, "link", "set", "lo", "up")


def _hosts_files(nodes: Sequence[Node]) -> None:
    lines = "".join(f"{n.address} {n.host}\n" for n in nodes)
    for node in nodes:
        directory = ETC_NETNS / node.netns
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text(f"127.0.0.1 localhost\n{lines}")


def _delete(names: Sequence[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            for pid in map(int, _ip("netns", "pids", name, check=False).stdout.split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            _ip("netns", "del", name, check=False)
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    with contextlib.suppress(OSError):
        ETC_NETNS.rmdir()  # only when empty: other users' entries stay


@contextlib.contextmanager
def cluster(*, nodes: int = 2) -> Iterator[Cluster]:
    """``nodes`` namespaces on one bridge, addresses ``10.213.<k>.1..nodes``; all
    removed when the block ends, processes inside killed ([Note: netns lifetime])."""
    if not 1 <= nodes <= 3:
        raise ValueError(f"nodes must be 1-3, got {nodes}")
    seq = next(_counter)
    base = f"{PREFIX}-{os.getpid()}-{seq}"
    k = (os.getpid() + seq) % 250 + 1
    made = Cluster(
        nodes=tuple(
            Node(i, f"{base}n{i}", f"{SUBNET}.{k}.{i + 1}", f"{PREFIX}-node{i}")
            for i in range(nodes)
        ),
        switch=f"{base}sw",
    )
    try:
        for name in made.names:
            _ip("netns", "add", name)
        _ip("-n", made.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", made.switch, "link", "set", "br0", "up")
        for node in made.nodes:
            _wire(node, switch=made.switch, prefix_len=24)
        _hosts_files(made.nodes)
        yield made
    finally:
        made.kill_all(grace_s=2.0)
        _delete(made.names)


def ours() -> list[str]:
    """Namespaces on this machine named by this module."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}-")]


def remove_stale() -> list[str]:
    """Delete namespaces of this module whose creating process is gone (a killed test
    run), with any process still inside them; the names removed."""
    stale = []
    for name in ours():
        pid = name.split("-")[1]
        if pid.isdigit() and (int(pid) == os.getpid() or not Path(f"/proc/{pid}").exists()):
            stale.append(name)
    _delete(stale)
    return stale
