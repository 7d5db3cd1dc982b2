"""Addresses as others reach them (transport layer)."""

from __future__ import annotations

import socket

__all__ = ["advertised"]


def advertised(address: str) -> str:
    """A bound address as peers can reach it: a wildcard host becomes this host's address."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if address.startswith(wildcard):
            host = socket.gethostbyname(socket.gethostname())
            return f"tcp://{host}:{address[len(wildcard) :]}"
    return address
