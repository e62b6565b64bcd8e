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


def test_a_table_from_another_namespace_is_parsed() -> None:
    """What ``ip netns exec NODE cat /proc/net/tcp /proc/net/tcp6`` printed for a
    node at 10.213.23.1 (tests/netns.py): listeners only, headers skipped."""
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "   0: 0117D50A:733C 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 17 1\n"
        "   1: 0117D50A:95E5 0117D50A:8934 01 00000000:00000000 00:00000000 00000000 0 0 18 1\n"
        "  sl  local_address                         remote_address                        st\n"
        "   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A "
        "00000000:00000000 00:00000000 00000000 0 0 19 1\n"
    )
    found = [(lst.address, lst.port, lst.inode) for lst in netinfo.parse_listening(text)]
    assert found == [("10.213.23.1", 29500, 17), ("::", 8080, 19)]
