"""An in-memory `Group` for testing algorithms without sockets (shipped test helper).

`MemoryNetwork(n)` connects n `MemoryGroup`s through in-process queues (the transport's
`Mailbox`), so every algorithm of `dsml.collectives` runs as it does over ZeroMQ, in one
event loop, in microseconds:

    net = MemoryNetwork(4, chunk_bytes=64)
    results = await net.run(lambda g: all_reduce_ring(g, NUMPY, src[g.rank], ...))

Payload bytes are copied when sent (as the wire would), and `recv` checks step, chunk and
payload size exactly as the communicator's `Call` does. Two faults can be injected:

* `kill(rank, after_sends=k)`: the rank dies once it has sent k messages; every rank still
  waiting fails with `PeerLostError` (delivered as a value where it waits, as in the
  communicator), and the dead rank's own next send raises it too.
* `run(fn, labels=...)`: each rank's messages carry its label (a stand-in for the
  fingerprint); a rank receiving a message with another label raises
  `CollectiveMismatchError`, and so does every other rank (the abort).

A run that would hang (ranks waiting for messages never sent) fails with
`CollectiveTimeoutError` after `timeout` seconds instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ..collectives.group import Lane, Received
from ..errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    ProtocolError,
)
from ..transport import DONE, Mailbox, Sent

__all__ = ["MemoryGroup", "MemoryNetwork"]

T = TypeVar("T")
_EMPTY = memoryview(b"")
Message = tuple[int, int, str, bytes, dict[str, Any] | None]  # step, chunk, label, data, meta


class MemoryNetwork:
    """n groups wired to each other in memory; see the module docstring."""

    def __init__(self, size: int, *, chunk_bytes: int = 4096) -> None:
        assert size >= 1
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.sent = [0] * size  # messages sent, per rank
        self._mailbox: Mailbox[Message] = Mailbox()
        self._deaths: dict[int, int] = {}  # rank -> sends after which it dies
        self._dead: set[int] = set()
        self._failed: list[asyncio.Future[BaseException]] = []

    def kill(self, rank: int, *, after_sends: int = 0) -> None:
        """Make `rank` die once it has sent `after_sends` messages."""
        self._deaths[rank] = after_sends

    async def run(
        self,
        fn: Callable[[MemoryGroup], Awaitable[T]],
        *,
        labels: Sequence[str] | None = None,
        timeout: float = 5.0,  # noqa: ASYNC109 (the run's budget, as a collective has one)
    ) -> list[T | BaseException]:
        """Run fn(group) on every rank concurrently; outcomes in rank order (results, or
        the exception a rank ended with)."""
        loop = asyncio.get_running_loop()
        self._failed = [loop.create_future() for _ in range(self.size)]
        groups = [
            MemoryGroup(self, rank, labels[rank] if labels is not None else "")
            for rank in range(self.size)
        ]
        deadline = loop.call_later(timeout, self._time_out, timeout)
        try:
            outcomes = await asyncio.gather(*(fn(g) for g in groups), return_exceptions=True)
        finally:
            deadline.cancel()
        return list(outcomes)

    # -- what groups call -------------------------------------------------------------------

    def deliver(self, src: int, dst: int, lane: Lane, message: Message) -> None:
        if src in self._dead:
            raise self._lost_error(src, src)
        self.sent[src] += 1
        after = self._deaths.get(src)
        if after is not None and self.sent[src] > after:
            self._die(src)
            raise self._lost_error(src, src)
        self._mailbox.put(dst, (src, lane), message)

    async def take(self, dst: int, src: int, lane: Lane) -> Message:
        return await self._mailbox.get(dst, (src, lane), unless=self._failed[dst])

    def abort(self, error: CollectiveError) -> None:
        """Fail every rank still running with `error` (as the communicator's abort does)."""
        for failed in self._failed:
            if not failed.done():
                failed.set_result(error)

    # -- faults -----------------------------------------------------------------------------

    def _die(self, rank: int) -> None:
        self._dead.add(rank)
        for other, failed in enumerate(self._failed):
            if other != rank and not failed.done():
                failed.set_result(self._lost_error(rank, other))

    def _lost_error(self, lost: int, rank: int) -> PeerLostError:
        return PeerLostError(f"rank {lost} died (injected)", lost=[lost], rank=rank)

    def _time_out(self, timeout: float) -> None:
        for rank, failed in enumerate(self._failed):
            if not failed.done():
                failed.set_result(
                    CollectiveTimeoutError(f"rank {rank} waited more than {timeout:g} s", rank=rank)
                )

    def __repr__(self) -> str:
        return f"<MemoryNetwork size={self.size} sent={self.sent} dead={sorted(self._dead)}>"


class MemoryGroup:
    """One rank's `Group` over a `MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, rank: int, label: str = "") -> None:
        self.network = network
        self.label = label
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.network.size

    @property
    def chunk_bytes(self) -> int:
        return self.network.chunk_bytes

    async def send(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        payload: memoryview | None = None,
        *,
        meta: dict[str, Any] | None = None,
        lane: Lane = Lane.DATA,
    ) -> Sent:
        assert 0 <= peer < self.size, f"no rank {peer}"
        assert peer != self._rank, "a rank does not send to itself"
        data = bytes(payload) if payload is not None else b""  # a copy, as on the wire
        self.network.deliver(self._rank, peer, lane, (step, chunk, self.label, data, meta))
        await asyncio.sleep(0)  # let others run, as a real send may
        return DONE

    async def recv(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        *,
        nbytes: int | None = None,
        lane: Lane = Lane.DATA,
    ) -> Received:
        got_step, got_chunk, label, data, meta = await self.network.take(self._rank, peer, lane)
        if label != self.label:
            error = CollectiveMismatchError(
                f"rank {self._rank} runs {self.label!r} but rank {peer} runs {label!r}",
                ranks=(self._rank, peer),
                rank=self._rank,
            )
            self.network.abort(error)
            raise error
        if (got_step, got_chunk) != (step, chunk):
            raise ProtocolError(
                f"rank {peer} sent step {got_step} chunk {got_chunk} where step {step} "
                f"chunk {chunk} was due"
            )
        if nbytes is not None and len(data) != nbytes:
            raise ProtocolError(f"rank {peer} sent {len(data)} bytes, expected {nbytes}")
        return Received(memoryview(data) if data else _EMPTY, meta)

    def __repr__(self) -> str:
        return f"<MemoryGroup rank={self._rank}/{self.size} label={self.label!r}>"
