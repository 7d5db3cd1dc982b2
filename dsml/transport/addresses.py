"""Addresses as others reach them, and the interfaces to bind (transport layer)."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct

from ..errors import ConfigError

__all__ = [
    "advertised",
    "interface_address",
    "is_local_address",
    "is_loopback_host",
    "resolve_host",
    "route_to",
]

_WILDCARDS = ("tcp://0.0.0.0:", "tcp://*:")
_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


def advertised(address: str, toward: str | None = None) -> str:
    """A bound address as peers can reach it: a wildcard host becomes this host's address.

    With `toward` (the registry's address, which every peer reaches too), that is the
    address of the interface this host would use to reach it: the kernel's routing
    choice, learnt from a UDP socket `connect`, which sends nothing. Without it, or when
    that fails, it is what the host name resolves to (127.0.1.1 on Debian-family hosts,
    which other hosts cannot reach: bind a concrete address there).
    """
    for wildcard in _WILDCARDS:
        if address.startswith(wildcard):
            host = _route_to(toward) or socket.gethostbyname(socket.gethostname())
            return f"tcp://{host}:{address[len(wildcard) :]}"
    return address


def _route_to(address: str | None) -> str | None:
    """The local IPv4 address the kernel would send from to reach a tcp:// address."""
    if not address or not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rpartition(":")
    if host in ("", "*", "0.0.0.0") or not port.isdigit():
        return None
    return route_to(host, int(port))


def route_to(host: str, port: int = 9) -> str | None:
    """The local IPv4 address the kernel would send from to reach host (None: no route).

    A UDP socket's `connect` asks the routing table and sends nothing.
    """
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        local = str(s.getsockname()[0])
        return local if local != "0.0.0.0" else None
    return None


def resolve_host(host: str, what: str) -> str:
    """The IPv4 address of a host name (an address stays as it is).

    Raises:
        ConfigError: the name does not resolve; `what` says where it came from.
    """
    try:
        return socket.gethostbyname(host.strip("[]"))
    except OSError as exc:
        raise ConfigError(f"cannot resolve host {host!r} ({what}): {exc}") from None


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and names that resolve there (`localhost`)."""
    with contextlib.suppress(ValueError, OSError):
        return ipaddress.ip_address(socket.gethostbyname(host.strip("[]"))).is_loopback
    return False


def is_local_address(ip: str) -> bool:
    """True if this host has the IPv4 address ip (a socket can bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def interface_address(ifname: str) -> str:
    """The IPv4 address of the network interface named ifname (Linux), as DSML_IFNAME.

    Raises:
        ConfigError: no such interface, or it has no IPv4 address.
    """
    names = [name for _, name in socket.if_nameindex()]
    if ifname not in names:
        raise ConfigError(
            f"DSML_IFNAME={ifname!r}: this host has no such interface (it has {', '.join(names)})"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()))
        except OSError as exc:
            raise ConfigError(f"DSML_IFNAME={ifname!r} has no IPv4 address: {exc}") from None
    return socket.inet_ntoa(packed[20:24])
