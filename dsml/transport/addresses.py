"""Addresses as others reach them (transport layer)."""

from __future__ import annotations

import contextlib
import socket

__all__ = ["advertised"]

_WILDCARDS = ("tcp://0.0.0.0:", "tcp://*:")


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
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))
        local = str(s.getsockname()[0])
        return local if local != "0.0.0.0" else None
    return None
