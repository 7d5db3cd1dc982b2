"""The process-wide ZeroMQ context and socket bookkeeping (transport layer).

All dsml sockets of a process share one context with one I/O thread; the context lives as
long as the process, so closing a communicator never blocks on `zmq_ctx_term`. Sockets are
plain (non-blocking) pyzmq sockets: `sockets.py` integrates them with asyncio itself, which
costs a fraction of `zmq.asyncio`'s per-message futures. Every socket
we open is registered here until closed, so tests can prove nothing was left open.

Making the context first raises the soft descriptor limit to the hard one, and gives the
context room for as many sockets as the process may then open descriptors (libzmq's
default is 1,023 sockets, and the limit is fixed once a socket exists): see `limits.py`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import zmq

from ..errors import ConfigError
from .addresses import split_tcp, wants_ipv6
from .limits import check_group_fits, raise_descriptor_limit

__all__ = ["check_address", "check_peers_fit", "live_sockets", "new_socket", "use_family"]

_DEFAULT_MAX_SOCKETS = 1023  # libzmq's

_lock = threading.Lock()
_context: zmq.Context[zmq.Socket[bytes]] | None = None
_live: weakref.WeakSet[zmq.Socket[bytes]] = weakref.WeakSet()


def _shared_context() -> zmq.Context[zmq.Socket[bytes]]:
    global _context
    with _lock:
        if _context is None or _context.closed:
            fds = raise_descriptor_limit()
            context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
            most = context.get(zmq.SOCKET_LIMIT)
            context.set(zmq.MAX_SOCKETS, min(most, max(_DEFAULT_MAX_SOCKETS, fds)))
            _context = context
        return _context


def check_peers_fit(peers: int) -> None:
    """Raise `ConfigError` if links to `peers` peers would exceed this process's
    descriptor limit or its ZeroMQ context's socket limit."""
    check_group_fits(peers, _shared_context().get(zmq.MAX_SOCKETS))


def new_socket(socket_type: int, **options: Any) -> zmq.Socket[bytes]:
    """Open a socket of the shared context and apply options (name -> value)."""
    sock = _shared_context().socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    _live.add(sock)
    return sock


def use_family(sock: zmq.Socket[bytes], address: str) -> None:
    """Before bind or connect: let the socket take IPv6 where address needs it."""
    if wants_ipv6(address):
        sock.setsockopt(zmq.IPV6, 1)


def live_sockets() -> int:
    """How many dsml sockets of this process are open (a test fixture checks it is 0)."""
    return sum(1 for sock in list(_live) if not sock.closed)


def check_address(address: object, what: str) -> str:
    """Validate a `tcp://host:port` or `ipc://path` address, raising ConfigError."""
    if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
        raise ConfigError(
            f"{what} {address!r} is not an address: use tcp://host:port or ipc://path"
        )
    if address.startswith("tcp://"):
        split_tcp(address, what)
    return address
