"""Node 0's end of the launchers' link: welcomes nodes, relays failures (launch layer).

The messages and how a lost launcher is noticed: nodes.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from ..errors import ProtocolError
from ..transport import Endpoint
from ..transport.curve import is_loopback
from ..wire import Envelope, Fields, Kind
from .failure import Failure
from .nodes import (
    BEAT_S,
    LOST_S,
    FailureSink,
    NodeShape,
    cancel_task,
    failure_body,
    failure_from,
    lost_node,
)

__all__ = ["NodeBoard"]

log = logging.getLogger("dsml.run")

_MAX_MESSAGE_BYTES = 1 << 20
WAITING_S = 10.0  # node 0 names the nodes it has not heard from after this long ...
WAITING_AGAIN_S = 30.0  # ... and again this often


class NodeBoard:
    """Node 0's end of the link: welcomes nodes, relays failures, counts nodes done."""

    def __init__(self, shape: NodeShape, on_failure: FailureSink) -> None:
        self.shape = shape
        self._on_failure = on_failure
        self._endpoint: Endpoint | None = None
        self._nodes: dict[bytes, int] = {}  # identity -> node rank, welcomed
        self._hosts: dict[bytes, str] = {}  # identity -> the host it said it runs on
        self._heard: dict[bytes, float] = {}  # identity -> when it last said anything
        self._done: set[int] = set()
        self._lost: set[int] = set()
        self._changed = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        self._address = ""

    def open(self, address: str, curve: Any = None) -> NodeBoard:
        self._address = address
        self._endpoint = Endpoint.bind(
            address,
            self._dispatch,
            max_frame_bytes=_MAX_MESSAGE_BYTES,
            max_envelope_bytes=_MAX_MESSAGE_BYTES,
            name="launch-board",
            curve=curve,
        )
        self._watch = asyncio.get_running_loop().create_task(self._watch_nodes())
        return self

    def _dispatch(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        if sender in self._nodes:
            self._heard[sender] = asyncio.get_running_loop().time()
        if env.kind is Kind.LAUNCH_HELLO:
            self.handle_launch_hello(sender, env)
        elif env.kind is Kind.LAUNCH_BEAT and sender in self._nodes:
            assert self._endpoint is not None
            self._endpoint.send_nowait(sender, Envelope(Kind.LAUNCH_BEAT, body={}))
        elif env.kind is Kind.LAUNCH_FAILED and sender in self._nodes:
            self.handle_launch_failed(sender, env)
        elif env.kind is Kind.LAUNCH_DONE and sender in self._nodes:
            self._done.add(self._nodes[sender])
            self._changed.set()
        else:
            raise ProtocolError(f"the launchers' link does not accept {env.kind.name} here")

    def handle_launch_hello(self, sender: bytes, env: Envelope) -> None:
        theirs = NodeShape.from_wire(Fields(env.body, "LaunchHello"))
        reason = ""
        if (theirs.nnodes, theirs.nprocs) != (self.shape.nnodes, self.shape.nprocs):
            reason = (
                f"node 0 launched this job with {self.shape.describe()}, but this launch asked "
                f"for {theirs.describe()}: start every node with the same --nnodes and -n"
            )
        elif theirs.node_rank == 0 or theirs.node_rank in self._nodes.values():
            reason = f"node rank {theirs.node_rank} is already running in this job"
        assert self._endpoint is not None
        if reason:
            log.warning("refused a launcher: %s", reason)
            self._endpoint.send_nowait(
                sender, Envelope(Kind.LAUNCH_REFUSED, body={"reason": reason})
            )
            return
        self._nodes[sender] = theirs.node_rank
        self._hosts[sender] = (
            Fields(env.body, "LaunchHello").get_str("host", 256, optional=True) or ""
        )
        self._heard[sender] = asyncio.get_running_loop().time()
        welcome = {"host": socket.gethostname()}
        self._endpoint.send_nowait(sender, Envelope(Kind.LAUNCH_WELCOME, body=welcome))

    async def _watch_nodes(self) -> None:
        """Every welcomed node still running beats; one silent for LOST_S is lost. Nodes
        that never said hello are named after WAITING_S, and again every WAITING_AGAIN_S
        (the ranks here wait for them in silence until their join timeout)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        warn_at = started + WAITING_S
        while True:
            await asyncio.sleep(BEAT_S)
            if loop.time() >= warn_at and len(self._nodes) < self.shape.nnodes - 1:
                warn_at = loop.time() + WAITING_AGAIN_S
                log.warning("%s", self.waiting(loop.time() - started))
            for identity, node in self._nodes.items():
                silent = loop.time() - self._heard.get(identity, loop.time())
                if node in self._done or node in self._lost or silent < LOST_S:
                    continue
                self._lost.add(node)
                failure = lost_node(node, self._hosts.get(identity) or "")
                log.warning("%s", failure.report())
                self._relay(failure, but=identity)
                self._on_failure(failure)
                self._changed.set()

    def waiting(self, waited_s: float) -> str:
        """What node 0 says while nodes have not said hello yet."""
        missing = sorted(set(range(1, self.shape.nnodes)) - set(self._nodes.values()))
        names = ", ".join(map(str, missing))
        text = (
            f"still waiting after {waited_s:.0f} s for node{'s' if len(missing) > 1 else ''} "
            f"{names} of --nnodes {self.shape.nnodes} to reach this launcher at "
            f"{self._address} (--registry's port + 1). "
        )
        if is_loopback(self._address):
            return text + (
                "That is a loopback address, which launchers on other hosts cannot reach: "
                "give every node --registry tcp://HOST:PORT with an address of this host "
                "that they can reach"
            )
        text += "Start them with the same --registry, and check firewalls"
        return text

    def handle_launch_failed(self, sender: bytes, env: Envelope) -> None:
        failure = failure_from(env.body)
        self._relay(failure, but=sender)
        self._on_failure(failure)

    def report(self, failure: Failure) -> None:
        """A rank of node 0 failed: tell every other node."""
        self._relay(failure, but=b"")

    def _relay(self, failure: Failure, but: bytes) -> None:
        assert self._endpoint is not None
        for identity in self._nodes:
            if identity != but:
                env = Envelope(Kind.LAUNCH_FAILED, body=failure_body(failure))
                self._endpoint.send_nowait(identity, env)

    async def wait_nodes_done(self, group_gone: Callable[[], bool], grace_s: float) -> None:
        """Wait until every welcomed node said its ranks ended, or the group has been
        gone from the registry (no member left) for grace_s (a launcher killed)."""
        gone_since: float | None = None
        loop = asyncio.get_running_loop()
        while len(self._done | self._lost) < len(self._nodes):
            self._changed.clear()
            if group_gone():
                gone_since = gone_since if gone_since is not None else loop.time()
                if loop.time() - gone_since >= grace_s:
                    missing = sorted(set(self._nodes.values()) - self._done - self._lost)
                    log.warning("nodes %s never said their ranks ended", missing)
                    return
            else:
                gone_since = None
            try:
                async with asyncio.timeout(0.2):
                    await self._changed.wait()
            except TimeoutError:
                pass

    def farewell(self, code: int) -> None:
        """Node 0 is done: tell every node still running, which then stops watching it (a
        node whose ranks outlive the group, writing their results, must not take node 0's
        end for its loss)."""
        assert self._endpoint is not None
        for identity, node in self._nodes.items():
            if node not in self._done and node not in self._lost:
                env = Envelope(Kind.LAUNCH_DONE, body={"code": code})
                self._endpoint.send_nowait(identity, env)

    async def aclose(self) -> None:
        await cancel_task(self._watch)
        if self._endpoint is not None:
            await self._endpoint.aclose()
