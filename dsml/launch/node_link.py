"""Node i's end of the launchers' link, i > 0: hello, beats, reports (launch layer).

The messages and how a lost launcher is noticed: nodes.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from typing import Any

from ..errors import ConfigError, DsmlError, ProtocolError
from ..transport import Channel
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

__all__ = ["NodeLink"]

log = logging.getLogger("dsml.run")

_DROPS_BEFORE_ANSWER = 5


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
                failure = lost_node(0, self._host0 or "")
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
            self._on_failure(failure_from(env.body))
        else:
            raise ProtocolError(f"node 0's launcher does not send {env.kind.name}")

    def report(self, failure: Failure) -> None:
        """A rank of this node failed: tell node 0, which tells the others."""
        if self._channel is not None and not self._channel.closed:
            self._channel.send_nowait(Envelope(Kind.LAUNCH_FAILED, body=failure_body(failure)))

    async def done(self, code: int) -> None:
        if self._channel is not None and not self._channel.closed:
            await self._channel.send(Envelope(Kind.LAUNCH_DONE, body={"code": code}))

    async def aclose(self) -> None:
        await cancel_task(self._beat)
        if self._channel is not None and not self._channel.closed:
            await self._channel.aclose()
