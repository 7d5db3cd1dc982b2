"""The link between the launchers of one multi-node `dsml run` (launch layer).

`dsml run -n K --nnodes N --node-rank I --registry tcp://HOST:PORT` starts K ranks on each
of N hosts. Node 0's launcher serves the group's registry at HOST:PORT and this link at
HOST:PORT+1 (`link_address`). Every other launcher connects, says which node it is and
its shape (LAUNCH_HELLO), and starts its ranks only once node 0 welcomed it: a launch
whose --nnodes or -n disagree with node 0's (so its world size would), or whose node rank
is already running, is refused with the reason, before any rank starts.

When a rank fails, its launcher reports it (LAUNCH_FAILED: node, rank, exit code, last
lines of its error output); node 0 passes every report on to all the other launchers, so
each stops its ranks and prints the root cause. A launcher whose ranks all ended says so
(LAUNCH_DONE); node 0 keeps the registry up until every node has.

Every launcher beats on the link each second (LAUNCH_BEAT; node 0 answers each). A node
0 that hears nothing from a node for LOST_S, or a node that hears nothing from node 0,
takes that node's launcher for lost (killed, or its host went down: its ranks die with
it) and reports it as the root cause, as a failed rank is reported, instead of whichever
of its own ranks then fails because peers vanished.

`node_board.py` is node 0's end, `node_link.py` every other node's; this module holds what
both ends use: a node's shape, the link's address and the failure report on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ProtocolError
from ..transport.addresses import format_tcp, split_tcp
from ..wire import Fields
from .failure import Failure

__all__ = [
    "BEAT_S",
    "LOST_S",
    "FailureSink",
    "NodeShape",
    "cancel_task",
    "failure_body",
    "failure_from",
    "link_address",
    "lost_node",
]

_MAX_NODES = 1 << 14
_TAIL_LINES = 64
BEAT_S = 1.0  # launchers beat on the link this often ...
LOST_S = 10.0  # ... and one not heard from for this long is lost

#: Called with each failure reported by another node's launcher.
FailureSink = Callable[[Failure], None]


@dataclass(frozen=True, slots=True)
class NodeShape:
    """One launcher's part of a multi-node job."""

    nnodes: int
    nprocs: int  # ranks per node
    node_rank: int

    def __post_init__(self) -> None:
        if not 1 <= self.nnodes <= _MAX_NODES:
            raise ConfigError(f"--nnodes must be in 1..{_MAX_NODES}, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}"
            )
        if self.nprocs < 1:
            raise ConfigError(f"-n must be at least 1, got {self.nprocs}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nprocs

    @property
    def ranks(self) -> range:
        """The global ranks this node starts: node_rank * nprocs + local rank."""
        start = self.node_rank * self.nprocs
        return range(start, start + self.nprocs)

    def describe(self) -> str:
        return f"--nnodes {self.nnodes} -n {self.nprocs} (world size {self.world_size})"

    def to_wire(self) -> dict[str, Any]:
        return {"nnodes": self.nnodes, "nprocs": self.nprocs, "node_rank": self.node_rank}

    @classmethod
    def from_wire(cls, fields: Fields) -> NodeShape:
        try:
            return cls(
                fields.get_int("nnodes", 1, _MAX_NODES),
                fields.get_int("nprocs", 1, 1 << 16),
                fields.get_int("node_rank", 0, _MAX_NODES),
            )
        except ConfigError as exc:
            raise ProtocolError(str(exc)) from None


def link_address(registry: str) -> str:
    """The launchers' link: the registry's host at the registry's port + 1."""
    try:
        host, port = split_tcp(registry, "--registry")
    except ConfigError:
        host, port = "", ""
    if not port.isdigit() or not 0 < int(port) < 65535:
        raise ConfigError(
            f"--nnodes needs --registry tcp://HOST:PORT (IPv6: tcp://[ADDR]:PORT) with a "
            f"fixed port (node 0 serves the registry there and the launchers' link at "
            f"PORT+1), got {registry!r}"
        )
    return format_tcp(host, int(port) + 1)


def failure_body(failure: Failure) -> dict[str, Any]:
    """A LAUNCH_FAILED message's body."""
    return {
        "rank": failure.rank,
        "code": failure.code,
        "node": failure.node if failure.node is not None else -1,
        "host": failure.host,
        "tail": failure.tail[-_TAIL_LINES:],
        "signal": failure.signal,
        "lost": failure.lost,
    }


def failure_from(body: Any) -> Failure:
    """The failure a LAUNCH_FAILED body reports (ProtocolError if malformed)."""
    fields = Fields(body, "LaunchFailed")
    node = fields.get_int("node", -1, _MAX_NODES)
    return Failure(
        rank=fields.get_int("rank", -1, 1 << 31),  # -1: the node itself (interrupted)
        code=fields.get_int("code", -255, 255),
        tail=fields.get_str_list("tail", _TAIL_LINES, 4096),
        node=None if node < 0 else node,
        host=fields.get_str("host", 256),
        signal=fields.get_str("signal", 16, optional=True) or "",  # absent: an older launcher
        lost=fields.get_str("lost", 256, optional=True) or "",
    )


def lost_node(node: int, host: str) -> Failure:
    """A node whose launcher was not heard from for LOST_S."""
    reason = f"its launcher was not heard from for {LOST_S:g} s (killed, or its host is down)"
    return Failure(rank=-1, code=1, node=node, host=host, lost=reason)


async def cancel_task(task: asyncio.Task[None] | None) -> None:
    """Cancel an end's background task (if it has one) and wait until it ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
