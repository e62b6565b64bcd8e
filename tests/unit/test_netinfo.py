"""Listening sockets read from /proc (fsdpkit.netinfo): who holds a port, on which address."""

from __future__ import annotations

import os
import socket

from fsdpkit import netinfo


def test_listeners_are_read_from_proc() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        mine = [lst for lst in netinfo.listeners([os.getpid()]) if lst.port == port]
        assert mine and mine[0].address == "127.0.0.1" and mine[0].loopback_only
        assert netinfo.port_holder(port) == f"pid {os.getpid()} ({netinfo.command_of(os.getpid())})"
    assert netinfo.loopback_interface() == netinfo.interface_of("127.0.0.1") == "lo"
