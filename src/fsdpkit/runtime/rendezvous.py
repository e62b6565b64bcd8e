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

[Note: lost rendezvous]
The agent of a node that joined (not the one hosting the store) asks the store five
times a second whether nodes are waiting. With the link to the host cut, a TCP
request gets no answer and no reset, and torch's client waits its timeout: the join
timeout (600 s; and measured on a cut veth, a ``get`` still had not returned 40 s
after its 10 s timeout warned), then again when the agent closes the rendezvous on
its way out, while its workers were long stopped. So on a joined node each of these
requests runs in a daemon thread given ``parallel.timeout_s`` (the ``store_timeout``
rendezvous option); one without an answer by then raises ``NodeLostError`` naming
the endpoint (the thread is left blocked: the launcher is on its way out), and the
closing requests are skipped: the node stops about ``parallel.timeout_s`` after the
cut.

[Note: rejoined node]
torch's rendezvous (with the agent's store shared by the workers, as here) has the
round's rank 0 publish the workers' store address (MASTER_ADDR/PORT) under that
round's keys only on its first round. A node that comes back after its launcher died
(``--max-restarts``) is a fresh process: it waits for those keys of the new round,
which the surviving rank 0 never writes, until its store timeout, and the job never
restarts. So rank 0 writes them again after every round. For the same reason the
workers name their store's keys by the rendezvous round (``ROUND_VAR``, the same on
every node), not by the agent's restart count, which a fresh node starts at 0
([Note: restart attempts] in fsdpkit.runtime.distenv).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import pickle
import socket
import threading
import time
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
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


ROUND_VAR = "FSDPKIT_RDZV_ROUND"
"""The rendezvous round the workers are started in (set in the launcher's
environment, which the workers inherit: [Note: rejoined node])."""


class RendezvousError(UserError):
    """The rendezvous endpoint cannot be used; the message names the port and the fix."""


class NodeLostError(RuntimeError):
    """This node lost the rendezvous store ([Note: lost rendezvous])."""


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


def _host_or_join(
    host: str, port: int, *, nnodes: int, run_id: str, join_s: float
) -> tuple[TCPStore, bool]:
    """This node's handle on the agents' rendezvous store, and whether it hosts it
    (when the endpoint is one of its addresses; else it joins, [Note: busy rendezvous
    port])."""
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
        return _join(host, port, nnodes=nnodes, run_id=run_id, join_s=join_s), False
    record = {"run_id": run_id, "nnodes": nnodes, "host": socket.gethostname()}
    record["started"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    store.set(MARKER, json.dumps(record))
    return store, True


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
    joined = int(store.add(f"{MARKER}/{run_id}/joined", 1))
    if joined > nnodes - 1 and not _seat_frees(store, run_id, nnodes=nnodes, wait_s=ANSWER_S):
        raise _busy(
            host,
            port,
            f"the job there (started {record.get('started')} on {record.get('host')}) already "
            f"has all its {nnodes} nodes: another job uses this endpoint",
        )
    return store


KEEP_ALIVE_S = 5.0
"""torch's dynamic rendezvous: every node's heartbeat interval (its default)."""


def _seat_frees(store: TCPStore, run_id: str, *, nnodes: int, wait_s: float) -> bool:
    """Whether the job's rendezvous seats one more node within ``wait_s``: a node
    coming back after its launcher died (``--max-restarts``) finds a round still
    gathering nodes, or a participant whose heartbeat stopped (torch drops it, then
    opens the next round); a node of another job finds neither ([Note: busy
    rendezvous port]). torch's own rendezvous state, which its handler unpickles
    the same way (the job's network is trusted, [Note: listeners])."""
    backend = C10dRendezvousBackend(store, run_id)
    deadline = time.monotonic() + wait_s
    while True:
        got = backend.get_state()
        if got is None:
            return True
        state = pickle.loads(got[0])
        now = datetime.datetime.now(datetime.UTC)
        beats = getattr(state, "last_heartbeats", {}).values()
        stale = any((now - beat).total_seconds() > 2 * KEEP_ALIVE_S for beat in beats)
        if not state.complete or stale or len(state.participants) < nnodes:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


class _BoundDynamicHandler(DynamicRendezvousHandler):
    """torch's c10d rendezvous, with the workers' store bound to ``bind_addr``, that
    says when it loses the store ([Note: lost rendezvous])."""

    bind_addr = "127.0.0.1"
    endpoint = ""
    lost_after_s: float | None = None
    """The store client's timeout when this node joined (None: it hosts the store)."""
    lost: NodeLostError | None = None

    def get_backend(self) -> str:
        return BACKEND

    def num_nodes_waiting(self) -> int:
        if self.lost_after_s is None:
            return super().num_nodes_waiting()
        box: dict[str, Any] = {}

        def ask() -> None:
            try:
                box["n"] = super(_BoundDynamicHandler, self).num_nodes_waiting()
            except RendezvousConnectionError as exc:
                box["error"] = exc

        asking = threading.Thread(target=ask, name="fsdpkit-rdzv-poll", daemon=True)
        asking.start()
        asking.join(self.lost_after_s)
        if "n" in box:
            return int(box["n"])
        if "error" not in box and not asking.is_alive():
            raise RuntimeError("the rendezvous poll ended without an answer")
        self.lost = NodeLostError(
            f"this node lost the rendezvous at {self.endpoint} (hosted by the first "
            f"node): a request got no answer within {self.lost_after_s:g} s "
            "(parallel.timeout_s). The network between this node and that one is down, "
            "or that node is gone; this node's ranks were stopped. Check the link and "
            "that node's log, then rerun the same command on every node."
        )
        raise self.lost

    def shutdown(self) -> bool:
        if self.lost is not None:  # every closing request would wait its timeout again
            self._abandon_heartbeats()
            return False
        return super().shutdown()

    def _abandon_heartbeats(self) -> None:
        """Stop the keep-alive timer without joining its thread: it is blocked on the
        lost store (torch's ``cancel`` joins it, and so would the timer's finalizer
        when the handler is collected)."""
        timer = self._keep_alive_timer
        finalizer = getattr(timer, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        with contextlib.suppress(AttributeError):
            timer._ctx.stop_event.set()  # type: ignore[union-attr]

    def next_rendezvous(self) -> RendezvousInfo:
        """torch's, and [Note: rejoined node]."""
        info = super().next_rendezvous()
        os.environ[ROUND_VAR] = str(self._state_holder.state.round)
        boot = info.bootstrap_store_info
        if info.rank == 0 and boot is not None:
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, boot.master_addr)
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(boot.master_port))
        return info

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
    store, hosted = _host_or_join(
        host, port, nnodes=params.max_nodes, run_id=params.run_id, join_s=join_s
    )
    lost_after_s = float(params.get("store_timeout", 0) or 0) or None
    if lost_after_s is not None and not hosted:
        store.set_timeout(datetime.timedelta(seconds=lost_after_s))
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
    handler.endpoint = f"{host}:{port}"
    handler.lost_after_s = None if hosted else lost_after_s
    return handler


_registered = threading.Lock()


def register() -> str:
    """Register the ``fsdpkit`` rendezvous backend with torch's elastic agent
    (idempotent); returns its name for ``LaunchConfig.rdzv_backend``."""
    with _registered:
        rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND
