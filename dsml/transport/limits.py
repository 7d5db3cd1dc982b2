"""File descriptors and ZeroMQ sockets: raising the limits, checking a group fits (transport).

Every peer of a view costs a rank a few descriptors and ZeroMQ sockets (a DEALER to it and
the pair of sockets that monitor it, its connection out and its connection in), so a large
group runs into the soft `RLIMIT_NOFILE` (1,024 by default on Linux) and into libzmq's
socket limit (1,023 per context by default) long before memory. dsml therefore:

- raises the soft descriptor limit to the hard one when the process's ZeroMQ context is
  made (`raise_descriptor_limit`, called by `context.py`), which needs no privilege;
- makes that context with room for as many sockets as the process may open descriptors
  (a socket takes at least one);
- checks, once a view is known and before connecting to its peers, that the group fits
  (`check_group_fits`): else a `ConfigError` that names the limit and what the group
  needs, on every rank, instead of `Too many open files` somewhere in the middle.

The costs per peer are measured (docs/scale.md), with a margin; they are estimates, so
the check errs towards letting a group try.
"""

from __future__ import annotations

import resource

from ..errors import ConfigError

__all__ = [
    "FDS_BASE",
    "FDS_PER_PEER",
    "SOCKETS_BASE",
    "SOCKETS_PER_PEER",
    "check_group_fits",
    "descriptor_limit",
    "raise_descriptor_limit",
]

#: descriptors a rank uses whatever the group's size: the interpreter, the endpoint,
#: the registry link, the wake-up sockets of shared memory, pipes to the launcher (measured
#: about 22 at rest; the rest is room for the program's own files)
FDS_BASE = 48
#: per peer: DEALER, its monitor's two sockets, the connection out, the connection in
FDS_PER_PEER = 5
#: ZeroMQ sockets: the endpoint, the registry link and its monitor, margin
SOCKETS_BASE = 16
#: per peer: the DEALER and its monitor's two sockets
SOCKETS_PER_PEER = 3
#: never raise the soft limit above this (a hard limit of "unlimited" is not a number)
_MOST_FDS = 1 << 20


def descriptor_limit() -> tuple[int, int]:
    """The soft and hard `RLIMIT_NOFILE` of this process (unlimited as a large number)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = _MOST_FDS
    if hard == resource.RLIM_INFINITY:
        hard = _MOST_FDS
    return soft, hard


def raise_descriptor_limit() -> int:
    """Raise the soft descriptor limit to the hard one; returns the soft limit now."""
    soft, hard = descriptor_limit()
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit above the kernel's nr_open
            return soft
        return hard
    return soft


def check_group_fits(peers: int, max_sockets: int) -> None:
    """Raise `ConfigError` if a rank with `peers` peers would run out of descriptors or of
    ZeroMQ sockets (`max_sockets`: the context's limit)."""
    soft, hard = descriptor_limit()
    fds = FDS_BASE + FDS_PER_PEER * peers
    if fds > soft:
        raise ConfigError(
            f"a group of {peers + 1} ranks needs about {fds} open file descriptors per rank "
            f"({FDS_PER_PEER} per peer), but this process may open {soft} (RLIMIT_NOFILE: "
            f"soft {soft}, hard {hard}; dsml raised the soft limit as far as the hard one "
            f"allows). Raise the hard limit (ulimit -Hn {fds} as root, or nofile in "
            "/etc/security/limits.conf, or LimitNOFILE= for a service), or run fewer ranks"
        )
    sockets = SOCKETS_BASE + SOCKETS_PER_PEER * peers
    if sockets > max_sockets:
        raise ConfigError(
            f"a group of {peers + 1} ranks needs about {sockets} ZeroMQ sockets per rank "
            f"({SOCKETS_PER_PEER} per peer), but this process's ZeroMQ context allows "
            f"{max_sockets} (zmq.MAX_SOCKETS, sized from RLIMIT_NOFILE when the first dsml "
            "socket was made). Raise the descriptor limit before the program starts, or "
            "run fewer ranks"
        )
