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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, DsmlError, ProtocolError
from ..transport import Channel, Endpoint
from ..transport.addresses import format_tcp, split_tcp
from ..transport.curve import is_loopback
from ..wire import Envelope, Fields, Kind
from .launcher import Failure

__all__ = ["NodeBoard", "NodeLink", "NodeShape", "link_address"]

log = logging.getLogger("dsml.run")

_MAX_MESSAGE_BYTES = 1 << 20
_MAX_NODES = 1 << 14
_TAIL_LINES = 64
_DROPS_BEFORE_ANSWER = 5
BEAT_S = 1.0  # launchers beat on the link this often ...
LOST_S = 10.0  # ... and one not heard from for this long is lost
WAITING_S = 10.0  # node 0 names the nodes it has not heard from after this long ...
WAITING_AGAIN_S = 30.0  # ... and again this often

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


def _failure_body(failure: Failure) -> dict[str, Any]:
    return {
        "rank": failure.rank,
        "code": failure.code,
        "node": failure.node if failure.node is not None else -1,
        "host": failure.host,
        "tail": failure.tail[-_TAIL_LINES:],
        "signal": failure.signal,
        "lost": failure.lost,
    }


def _failure_from(body: Any) -> Failure:
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


def _lost_node(node: int, host: str) -> Failure:
    """A node whose launcher was not heard from for LOST_S."""
    reason = f"its launcher was not heard from for {LOST_S:g} s (killed, or its host is down)"
    return Failure(rank=-1, code=1, node=node, host=host, lost=reason)


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
                failure = _lost_node(node, self._hosts.get(identity) or "")
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
        failure = _failure_from(env.body)
        self._relay(failure, but=sender)
        self._on_failure(failure)

    def report(self, failure: Failure) -> None:
        """A rank of node 0 failed: tell every other node."""
        self._relay(failure, but=b"")

    def _relay(self, failure: Failure, but: bytes) -> None:
        assert self._endpoint is not None
        for identity in self._nodes:
            if identity != but:
                env = Envelope(Kind.LAUNCH_FAILED, body=_failure_body(failure))
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
        await _cancel(self._watch)
        if self._endpoint is not None:
            await self._endpoint.aclose()


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class NodeLink:
    """Node i's end of the link (i > 0)."""

    def __init__(self, shape: NodeShape, on_failure: FailureSink) -> None:
        self.shape = shape
        self._on_failure = on_failure
        self._channel: Channel | None = None
        self._answer: asyncio.Future[Envelope] | None = None
        self._drops = 0  # connections lost before node 0 answered
        self._heard = 0.0  # when node 0 last said anything
        self._host0 = ""  # node 0's host, from its welcome
        self._beat: asyncio.Task[None] | None = None
        self._zero_done = False  # node 0 said it ended (its silence is no loss then)

    async def open(self, address: str, *, timeout_s: float, curve: Any = None) -> NodeLink:
        """Say hello to node 0 and wait for its welcome.

        Raises:
            ConfigError: node 0 refused this launch (the reason says why).
            DsmlError: node 0's launcher did not answer within timeout_s.
        """
        self._answer = asyncio.get_running_loop().create_future()
        identity = f"node{self.shape.node_rank}-{secrets.token_hex(4)}".encode()
        self._channel = Channel.connect(
            address,
            identity,
            handler=self._dispatch,
            linger_s=1.0,
            curve=curve,
            on_refused=self._on_refused,
            on_disconnect=self._on_disconnect,
        )
        hello = self.shape.to_wire() | {"host": socket.gethostname()}
        await self._channel.send(Envelope(Kind.LAUNCH_HELLO, body=hello))
        try:
            async with asyncio.timeout(timeout_s):
                answer = await self._answer
        except ConfigError:
            await self.aclose()
            raise
        except TimeoutError:
            await self.aclose()
            raise DsmlError(
                f"no `dsml run --node-rank 0` answered at {address} within "
                f"{timeout_s:g} s: start node 0 with the same --registry (it serves the "
                "registry at PORT and the launchers' link at PORT+1), and check firewalls"
            ) from None
        if answer.kind is Kind.LAUNCH_REFUSED:
            await self.aclose()
            reason = Fields(answer.body, "LaunchRefused").get_str("reason", 4096)
            raise ConfigError(f"node 0 refused node {self.shape.node_rank}: {reason}")
        self._host0 = Fields(answer.body, "LaunchWelcome").get_str("host", 256, optional=True)
        self._beat = asyncio.get_running_loop().create_task(self._beat_node_zero())
        return self

    async def _beat_node_zero(self) -> None:
        """Beat each second; node 0 silent for LOST_S is lost (reported once)."""
        loop = asyncio.get_running_loop()
        while self._channel is not None and not self._channel.closed:
            self._channel.send_nowait(Envelope(Kind.LAUNCH_BEAT, body={}))
            await asyncio.sleep(BEAT_S)
            if self._zero_done:
                return
            if loop.time() - self._heard >= LOST_S:
                failure = _lost_node(0, self._host0 or "")
                log.warning("%s", failure.report())
                self._on_failure(failure)
                return

    def _on_refused(self, reason: str) -> None:
        self._fail_hello(f"node 0's launcher refused the connection: {reason}")

    def _on_disconnect(self) -> None:
        """A CURVE server closes a plain client at once, again at each reconnection."""
        self._drops += 1
        if self._drops >= _DROPS_BEFORE_ANSWER:
            self._fail_hello(
                f"node 0's launcher closed the connection {self._drops} times without an "
                "answer: is CURVE on at one end only?"
            )

    def _fail_hello(self, reason: str) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(
                ConfigError(f"{reason}. Pass the same --curve-keys DIR on every node (or none)")
            )

    def _dispatch(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        self._heard = asyncio.get_running_loop().time()
        if env.kind is Kind.LAUNCH_BEAT:
            return
        if env.kind is Kind.LAUNCH_DONE:  # node 0 ended: nothing more to hear from it
            self._zero_done = True
            return
        if env.kind in (Kind.LAUNCH_WELCOME, Kind.LAUNCH_REFUSED):
            if self._answer is not None and not self._answer.done():
                self._answer.set_result(env)
        elif env.kind is Kind.LAUNCH_FAILED:
            self._on_failure(_failure_from(env.body))
        else:
            raise ProtocolError(f"node 0's launcher does not send {env.kind.name}")

    def report(self, failure: Failure) -> None:
        """A rank of this node failed: tell node 0, which tells the others."""
        if self._channel is not None and not self._channel.closed:
            self._channel.send_nowait(Envelope(Kind.LAUNCH_FAILED, body=_failure_body(failure)))

    async def done(self, code: int) -> None:
        if self._channel is not None and not self._channel.closed:
            await self._channel.send(Envelope(Kind.LAUNCH_DONE, body={"code": code}))

    async def aclose(self) -> None:
        await _cancel(self._beat)
        if self._channel is not None and not self._channel.closed:
            await self._channel.aclose()
