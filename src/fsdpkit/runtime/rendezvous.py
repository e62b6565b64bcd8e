"""Rendezvous stores that listen only where they must, and fail fast on a busy port.

[Note: listeners]
A training job opens three kinds of listening sockets: the elastic agent's
rendezvous store, the store the workers bootstrap from, and the collective
library's (gloo / NCCL) peer sockets. torch's ``TCPStore`` server binds every
interface (``*:PORT``) whatever host it is given, so a single-node run used to accept
connections from the whole network. fsdpkit binds each store to one address itself
(a socket passed to ``TCPStore(master_listen_fd=...)``) and points gloo / NCCL at one
interface (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``):

- one node: every listener on loopback (127.0.0.1 / ``lo``);
- several nodes: the address this node uses to reach ``--rdzv-endpoint`` (or
  ``--local-addr``), i.e. the network the other nodes come from. Anything on that
  network can connect to those ports for the job's lifetime (TCPStore has no
  authentication): run multi-node jobs on a trusted cluster network.

[Note: busy rendezvous port]
``--rdzv-endpoint HOST:PORT`` with PORT held by another program used to hang until
the join timeout (the client waits for a store protocol answer that never comes).
Now: on one node the launcher must host the store, so a busy port fails at once,
naming the holder when /proc tells. With several nodes, a node that cannot bind
(another node on this machine may host it) connects as a client, but gives the
listener ``ANSWER_S`` seconds to answer as a store, to carry fsdpkit's marker, and
to have a free node slot; anything else fails with one paragraph.
"""

from __future__ import annotations

import datetime
import errno
import json
import socket
import threading
import time
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from fsdpkit import netinfo
from fsdpkit.errors import UserError

BACKEND = "fsdpkit"
"""The elastic rendezvous backend name this module registers."""
MARKER = "fsdpkit/rendezvous"
ANSWER_S = 30.0
"""Seconds a listener gets to answer like a rendezvous store (generous: a loaded
machine is slow, a foreign program never answers)."""
DEFAULT_PORT = 29400


class RendezvousError(UserError):
    """The rendezvous endpoint cannot be used; the message names the port and the fix."""


def _busy(host: str, port: int, why: str) -> RendezvousError:
    holder = netinfo.port_holder(port) if port else None
    held = f" It is held by {holder}." if holder else ""
    return RendezvousError(
        f"--rdzv-endpoint {host}:{port} cannot be used: {why}.{held} Choose a free port "
        f"(e.g. `python -c \"import socket; s=socket.socket(); s.bind(('', 0)); "
        f'print(s.getsockname()[1])"` prints one), or on a single node leave '
        "--rdzv-endpoint out and fsdpkit picks one."
    )


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (OSError as the kernel says)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(host: str, port: int, *, timeout: datetime.timedelta) -> TCPStore:
    """A TCPStore server listening on ``host:port`` only ([Note: listeners])."""
    sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    return TCPStore(
        host,
        bound,
        is_master=True,
        master_listen_fd=sock.detach(),  # the store owns (and closes) the socket
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timeout,
        use_libuv=True,
    )


def _wait_accepting(host: str, port: int, deadline: float) -> None:
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"nothing answers at {host}:{port} ({exc.strerror or exc}): the node "
                    "hosting the rendezvous did not start in time. Start every node with "
                    "the same --rdzv-endpoint (the first node's address and a free port)."
                ) from None
            time.sleep(0.5)


def connect_store(
    host: str, port: int, *, timeout: datetime.timedelta, answer_s: float | None = ANSWER_S
) -> TCPStore:
    """A TCPStore client of ``host:port``. Waits up to ``timeout`` for the port to
    accept, then ``answer_s`` seconds for a store to answer ([Note: busy rendezvous
    port]); RendezvousError otherwise. ``answer_s=None``: a store known to be ours
    (the agent's), connected to directly."""
    if answer_s is None:
        return TCPStore(host, port, is_master=False, timeout=timeout)
    _wait_accepting(host, port, time.monotonic() + timeout.total_seconds())
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = TCPStore(host, port, is_master=False, timeout=timeout)
        except Exception as exc:  # DistNetworkError & co.
            box["error"] = exc

    worker = threading.Thread(target=connect, name="fsdpkit-store-connect", daemon=True)
    worker.start()
    worker.join(answer_s)
    if "store" in box:
        return box["store"]
    raise _busy(host, port, "the program listening there does not answer as a rendezvous store")


def _host_or_join(host: str, port: int, *, nnodes: int, run_id: str, join_s: float) -> TCPStore:
    """This node's handle on the agents' rendezvous store: it hosts it when the
    endpoint is one of its addresses, else joins ([Note: busy rendezvous port])."""
    timeout = datetime.timedelta(seconds=60)
    try:
        store = serve_store(host, port, timeout=timeout)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE and nnodes == 1:
            raise _busy(host, port, "the port is in use") from None
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise _busy(host, port, exc.strerror or str(exc)) from None
        pid = netinfo.port_holder_pid(port) if exc.errno == errno.EADDRINUSE else None
        if pid is not None and not _is_fsdpkit_launcher(netinfo.command_of(pid)):
            raise _busy(host, port, "another program listens there") from None
        return _join(host, port, nnodes=nnodes, run_id=run_id, join_s=join_s)
    record = {"run_id": run_id, "nnodes": nnodes, "host": socket.gethostname()}
    record["started"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    store.set(MARKER, json.dumps(record))
    return store


def _is_fsdpkit_launcher(command: str) -> bool:
    """Another node of a job started on this machine (``fsdpkit train --nnodes``)."""
    return (
        "-m fsdpkit train" in command
        or "fsdpkit train" in command
        or ("fsdpkit/__main__.py train" in command)
    )


def _join(host: str, port: int, *, nnodes: int, run_id: str, join_s: float) -> TCPStore:
    store = connect_store(host, port, timeout=datetime.timedelta(seconds=join_s))
    try:
        store.wait([MARKER], datetime.timedelta(seconds=ANSWER_S))
        record = json.loads(store.get(MARKER))
    except Exception:
        raise _busy(
            host,
            port,
            "a rendezvous store that fsdpkit did not start (torchrun's "
            "or another program's) listens there",
        ) from None
    if record.get("run_id") != run_id or int(record.get("nnodes", 0)) != nnodes:
        raise _busy(host, port, f"another job's rendezvous listens there ({record})")
    if int(store.add(f"{MARKER}/{run_id}/joined", 1)) > nnodes - 1:
        raise _busy(
            host,
            port,
            f"the job there (started {record.get('started')} on {record.get('host')}) already "
            f"has all its {nnodes} nodes: another job uses this endpoint",
        )
    return store


class _BoundDynamicHandler(DynamicRendezvousHandler):
    """torch's c10d rendezvous, with the workers' store bound to ``bind_addr``."""

    bind_addr = "127.0.0.1"

    def get_backend(self) -> str:
        return BACKEND

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        return serve_store(self.bind_addr, master_port, timeout=datetime.timedelta(seconds=60))


class _BoundStaticHandler(StaticTCPRendezvous):
    """torch's static rendezvous (``--node-rank``), node 0's store bound to one address."""

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        if self.rank == 0 and self._store is None:
            try:
                self._store = serve_store(self.master_addr, self.master_port, timeout=self.timeout)
            except OSError as exc:
                raise _busy(self.master_addr, self.master_port, exc.strerror or str(exc)) from None
        return super().next_rendezvous()


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    join_s = float(params.get_as_int("join_timeout", 600) or 600)
    if "rank" in params.config:
        rank = int(params.config["rank"])
        return _BoundStaticHandler(host, port, rank, params.max_nodes, params.run_id, int(join_s))
    store = _host_or_join(host, port, nnodes=params.max_nodes, run_id=params.run_id, join_s=join_s)
    handler = _BoundDynamicHandler.from_backend(
        params.run_id,
        store,
        C10dRendezvousBackend(store, params.run_id),
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        RendezvousTimeout(join=datetime.timedelta(seconds=join_s)),
    )
    handler.bind_addr = params.local_addr or host
    return handler


_registered = threading.Lock()


def register() -> str:
    """Register the ``fsdpkit`` rendezvous backend with torch's elastic agent
    (idempotent); returns its name for ``LaunchConfig.rdzv_backend``."""
    with _registered:
        rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND
