"""Multi-node checks: reach the rendezvous, learn who else joined, agree on versions.

Every node runs ``fsdpkit doctor --nnodes N --rdzv-endpoint HOST:PORT``. The node
that can listen on HOST:PORT (``--node-rank 0``, or the first to bind it when no rank
is given) hosts a c10d TCPStore there, listening on that address only (127.0.0.1
for a loopback endpoint); the others connect. Each node publishes a ``NodeInfo``; all
compare them, then measure all-reduce bandwidth (``fsdpkit.doctor.bandwidth``).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import ipaddress
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from fsdpkit.doctor.check import Check, fail, ok
from fsdpkit.errors import UserError

PREFIX = "fsdpkit-doctor/"


class DoctorError(UserError, ValueError):
    """A doctor option is malformed (the message names it)."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        try:
            addr = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][4][0]
            return ipaddress.ip_address(addr).is_loopback
        except (OSError, ValueError):
            return False


def parse_endpoint(text: str) -> Endpoint:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DoctorError(
            f"--rdzv-endpoint {text!r} is not HOST:PORT with a port in 1..65535; use the "
            "same value on every node, e.g. --rdzv-endpoint node0:29400."
        )
    return Endpoint(host.strip("[]"), int(port))


@dataclass(frozen=True)
class NodeInfo:
    """What each node tells the others."""

    node_rank: int
    hostname: str
    torch_version: str
    fsdpkit_version: str
    python_version: str
    cuda_version: str | None
    nccl_version: str | None
    nproc: int
    device: str
    """"cuda" or "cpu": what the bandwidth workers run on."""


@dataclass
class Rendezvous:
    """A connected node: its store client, rank, and (on the host) the listener."""

    endpoint: Endpoint
    store: Any
    node_rank: int
    nnodes: int
    listener: socket.socket | None = None

    @property
    def hosting(self) -> bool:
        return self.listener is not None

    def close(self, *, timeout_s: float) -> None:
        """Say this node is done; the host waits for every node before closing."""
        self.store.set(f"{PREFIX}done/{self.node_rank}", "1")
        if self.hosting:  # nodes that never published their info are not waited for
            joined = [r for r in range(self.nnodes) if self.store.check([f"{PREFIX}node/{r}"])]
            keys = [f"{PREFIX}done/{r}" for r in joined]
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and not self.store.check(keys):
                time.sleep(0.05)
            assert self.listener is not None
            self.listener.close()


def _listen(endpoint: Endpoint, *, required: bool) -> socket.socket | None:
    """A listening socket bound to the endpoint's own address, or None when another
    process holds the port / the address is not this machine's (then connect)."""
    try:
        family = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((endpoint.host, endpoint.port))
        sock.listen(128)
        return sock
    except OSError as exc:
        if not required and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None
        if required:
            raise ConnectionError(f"cannot listen on {endpoint}: {exc.strerror or exc}") from None
        return None


def _client(endpoint: Endpoint, timeout_s: float) -> Any:
    """A store client, given up after ``timeout_s``: c10d's handshake waits without a
    deadline on a port whose program accepts but never answers (seen: 40 s and more)."""
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    result: list[Any] = []

    def attempt() -> None:
        try:
            result.append(TCPStore(endpoint.host, endpoint.port, None, False, timeout))
        except Exception as exc:
            result.append(exc)

    thread = threading.Thread(target=attempt, daemon=True)  # abandoned if it never returns
    thread.start()
    thread.join(timeout_s + 1)
    if not result:
        raise ConnectionError(
            "the port accepts connections but does not answer as a rendezvous store "
            "(another program holds it?)"
        )
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


def _store(endpoint: Endpoint, listener: socket.socket | None, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    if listener is None:
        return _client(endpoint, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    return TCPStore(
        endpoint.host,
        endpoint.port,
        None,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )


def _probe(endpoint: Endpoint, *, timeout_s: float) -> str | None:
    """Wait until something accepts TCP connections at the endpoint (node 0 may start
    later); the last reason when nothing did within ``timeout_s``. A plain socket, so a
    refused or filtered port is named as such (c10d's client only says "timed out")."""
    deadline = time.monotonic() + timeout_s
    reason = "no attempt"
    while True:
        try:
            with socket.create_connection(
                (endpoint.host, endpoint.port), timeout=max(min(2.0, timeout_s), 0.1)
            ):
                return None
        except socket.gaierror as exc:
            return f"cannot resolve {endpoint.host!r}: {exc.strerror or exc}"
        except ConnectionRefusedError:
            reason = "connection refused (nothing listens on that port)"
        except TimeoutError:
            reason = "no answer (a firewall drops the packets, or the host is down)"
        except OSError as exc:
            reason = exc.strerror or str(exc)
        if time.monotonic() > deadline:
            return reason
        time.sleep(0.25)


def _claim(store: Any, rank: int, nnodes: int) -> str | None:
    """Take node rank ``rank``; the reason when another node has it or it is out of range."""
    if not 0 <= rank < nnodes:
        return f"node rank {rank} is outside 0..{nnodes - 1} (more nodes than --nnodes {nnodes}?)"
    me = f"{socket.gethostname()}:{os.getpid()}"
    held = store.compare_set(f"{PREFIX}claim/{rank}", "", me).decode()
    return None if held == me else f"node rank {rank} is already taken by {held}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def connect(
    endpoint: Endpoint, *, nnodes: int, node_rank: int | None, timeout_s: float
) -> tuple[Rendezvous | None, Check]:
    """Host or join the doctor's rendezvous; the check says whether it worked."""
    name = "rendezvous"
    try:
        listener = _listen(endpoint, required=node_rank == 0) if node_rank in (None, 0) else None
        if listener is not None and endpoint.port == 0:  # one node: the port the OS chose
            endpoint = Endpoint(endpoint.host, listener.getsockname()[1])
        unreachable = None if listener is not None else _probe(endpoint, timeout_s=timeout_s)
        if unreachable:
            raise ConnectionError(unreachable)
        store = _store(endpoint, listener, timeout_s)
        if listener is not None:
            store.set(f"{PREFIX}host", json.dumps({"nnodes": nnodes}))
        else:
            store.wait([f"{PREFIX}host"], datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        return None, fail(
            name,
            f"cannot reach the rendezvous at {endpoint} within {timeout_s:.0f} s: "
            f"{_first_line(exc)}",
            "start node 0 with the same command, check the address and port (a port held by "
            "another program is not a doctor rendezvous), and that firewalls let TCP through",
        )
    host_nnodes = json.loads(store.get(f"{PREFIX}host"))["nnodes"]
    if host_nnodes != nnodes:
        return None, fail(
            name,
            f"this node says --nnodes {nnodes} but the host at {endpoint} says {host_nnodes}",
            "pass the same --nnodes on every node",
        )
    if node_rank is None:
        node_rank = 0 if listener is not None else int(store.add(f"{PREFIX}joined", 1))
    problem = _claim(store, node_rank, nnodes)
    if problem:
        return None, fail(name, problem, "give every node a distinct --node-rank (or none)")
    role = "hosting it" if listener is not None else "connected"
    return Rendezvous(endpoint, store, node_rank, nnodes, listener), ok(
        name, f"{endpoint} reached as node {node_rank} of {nnodes} ({role})"
    )


def exchange(
    rdzv: Rendezvous, info: NodeInfo, *, timeout_s: float
) -> tuple[list[NodeInfo] | None, Check]:
    """Publish this node's info and wait for every node's."""
    rdzv.store.set(f"{PREFIX}node/{rdzv.node_rank}", json.dumps(dataclasses.asdict(info)))
    keys = [f"{PREFIX}node/{r}" for r in range(rdzv.nnodes)]
    deadline = time.monotonic() + timeout_s
    while not rdzv.store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not rdzv.store.check([k])]
            return None, fail(
                "nodes joined",
                f"only {rdzv.nnodes - len(missing)} of {rdzv.nnodes} nodes joined within "
                f"{timeout_s:.0f} s; missing node rank(s) {missing}",
                "run the same doctor command on the missing nodes (or raise --timeout)",
            )
        time.sleep(0.05)
    nodes = [NodeInfo(**json.loads(rdzv.store.get(k))) for k in keys]
    hosts = ", ".join(f"{n.hostname} (node {n.node_rank})" for n in nodes)
    return nodes, ok("nodes joined", f"{len(nodes)} node(s): {hosts}")


_AGREE = (
    "torch_version",
    "fsdpkit_version",
    "python_version",
    "cuda_version",
    "nccl_version",
    "nproc",
    "device",
)


def check_agreement(nodes: list[NodeInfo]) -> Check:
    """Every node must run the same torch/fsdpkit/Python/CUDA/NCCL and rank count."""
    differ = [key for key in _AGREE if len({getattr(n, key) for n in nodes}) > 1]
    if differ:
        table = "; ".join(
            f"{key}: " + ", ".join(f"node {n.node_rank}={getattr(n, key)}" for n in nodes)
            for key in differ
        )
        return fail(
            "versions",
            f"nodes disagree on {', '.join(differ)} ({table}): collectives can hang or "
            "corrupt data when builds differ, and ranks are laid out per node",
            "install the same environment on every node (same container image or lock file)",
        )
    n = nodes[0]
    return ok(
        "versions",
        f"all {len(nodes)} nodes: torch {n.torch_version}, fsdpkit {n.fsdpkit_version}, "
        f"Python {n.python_version}, CUDA {n.cuda_version or '-'}, NCCL {n.nccl_version or '-'}, "
        f"{n.nproc} rank(s) on {n.device}",
    )
