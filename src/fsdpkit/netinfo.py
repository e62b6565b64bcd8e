"""What this machine's network looks like, read from /proc and /sys (Linux): listening
sockets and their processes, the loopback interface, the interface of an address.

Used to bind listeners where they must be ([Note: listeners] in
fsdpkit.runtime.rendezvous), to name who holds a busy port, and by the tests to check what a
run's processes listen on. Everything degrades to "unknown" (None / empty) where
/proc or /sys are not there or not readable.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"
_SIOCGIFADDR = 0x8915
_IFF_LOOPBACK = 0x8


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket."""

    address: str
    """The bound address: 127.0.0.1, ::1, 0.0.0.0 or :: (all interfaces), ..."""
    port: int
    inode: int
    pid: int | None = None
    """The process holding it, when readable."""

    @property
    def loopback_only(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def _hex_address(text: str) -> str:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in host byte order."""
    raw = bytes.fromhex(text)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return str(mapped or address)


def parse_listening(text: str) -> list[Listener]:
    """The listening sockets in the text of ``/proc/net/tcp`` and/or ``tcp6`` (header
    lines are skipped), without pids."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 10 or fields[3] != _LISTEN:
            continue
        host, port = fields[1].rsplit(":", 1)
        out.append(Listener(_hex_address(host), int(port, 16), int(fields[9])))
    return out


def _socket_table(net: str = "/proc/net") -> list[Listener]:
    """Listening sockets of one network namespace: ``/proc/net`` is this process's,
    ``/proc/PID/net`` that of process PID (a container's or ``ip netns``'s)."""
    texts = []
    for table in ("tcp", "tcp6"):
        try:
            texts.append(Path(net, table).read_text())
        except OSError:
            continue
    return parse_listening("\n".join(texts))


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()] if os.path.isdir("/proc") else []


def listeners(pids: Iterable[int] | None = None) -> list[Listener]:
    """Listening TCP sockets of ``pids`` (default: every process whose fds are
    readable), each with its pid. Each given pid's sockets are looked up in its own
    network namespace's table, so processes in other namespaces are seen too."""
    tables: dict[str, dict[int, Listener]] = {}
    out = []
    for pid in _all_pids() if pids is None else pids:
        net = "/proc/net" if pids is None else f"/proc/{pid}/net"
        if net not in tables:
            tables[net] = {lst.inode: lst for lst in _socket_table(net)}
        table = tables[net]
        for inode in _socket_inodes(pid) & table.keys():
            lst = table[inode]
            out.append(Listener(lst.address, lst.port, inode, pid))
    return out


def command_of(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:160] or "?"


def port_holder_pid(port: int) -> int | None:
    """The pid of the process listening on TCP ``port`` here, when /proc tells."""
    inodes = {lst.inode for lst in _socket_table() if lst.port == port}
    if inodes:
        for pid in _all_pids():
            if _socket_inodes(pid) & inodes:
                return pid
    return None


def port_holder(port: int) -> str | None:
    """``pid 123 (python -m http.server 8000)`` for the process listening on ``port``
    here; ``a process this user cannot inspect`` or None (nothing listens)."""
    if not any(lst.port == port for lst in _socket_table()):
        return None
    pid = port_holder_pid(port)
    return f"pid {pid} ({command_of(pid)})" if pid else "a process this user cannot inspect"


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux)."""
    for dev in sorted(Path("/sys/class/net").glob("*")):
        try:
            if int((dev / "flags").read_text(), 16) & _IFF_LOOPBACK:
                return dev.name
        except (OSError, ValueError):
            continue
    return None


def interface_of(address: str) -> str | None:
    """The interface that holds IPv4 ``address`` (for GLOO/NCCL_SOCKET_IFNAME)."""
    if ipaddress.ip_address(address).is_loopback:
        return loopback_interface()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:
                continue
            if socket.inet_ntoa(res[20:24]) == address:
                return name
    return None


def local_address_for(host: str) -> str:
    """This machine's IPv4 address on the route to ``host`` (no packet is sent)."""
    target = socket.gethostbyname(host)
    if ipaddress.ip_address(target).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))
        return str(s.getsockname()[0])


SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The variables gloo and NCCL read for the interface their sockets bind to."""


def collective_interface(*, peer: str | None) -> str | None:
    """The interface the collectives' sockets use ([Note: listeners] in
    fsdpkit.runtime.rendezvous): loopback when every rank is on this machine (no
    ``peer``, or a loopback one), else the interface of this machine's address on the
    route to ``peer`` (the rendezvous endpoint, MASTER_ADDR). The one rule for the
    launcher, its workers and the doctor's bandwidth test."""
    if peer is None:
        return loopback_interface()
    return interface_of(local_address_for(peer))


def socket_ifname_env(iface: str | None, *, current: Mapping[str, str]) -> dict[str, str]:
    """``GLOO/NCCL_SOCKET_IFNAME = iface`` for every one the user has not set in
    ``current`` (a user's own choice wins); empty without an interface."""
    if not iface:
        return {}
    return {key: iface for key in SOCKET_IFNAME_VARS if key not in current}
