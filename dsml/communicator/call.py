"""One operation in flight, seen by algorithms as a `Group` (communicator layer).

A `Call` stamps every message it sends with its epoch, collective id and fingerprint, and
takes the messages addressed to it from the mesh's mailbox, checking that each is the step
and chunk the algorithm expects with the payload size it expects. When the operation
must fail (a peer's abort, a mismatch seen on arrival) the mesh calls `fail`, which
cancels the running task; the runner turns that cancellation into the stored error.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..collectives.group import Lane, Receipt, Received
from ..errors import ProtocolError
from ..wire import Envelope, Fingerprint, Kind

if TYPE_CHECKING:
    from .mesh import Mesh

__all__ = ["Call"]

_EMPTY = memoryview(b"")
_KINDS = {Lane.DATA: Kind.CHUNK, Lane.CONFIRM: Kind.CONFIRM}


class Call:
    """A collective (or a point-to-point receive) of one epoch; implements Group."""

    def __init__(
        self,
        mesh: Mesh,
        cid: int,
        fingerprint: Fingerprint,
        timeout: float,
        *,
        peer: int | None = None,
        tag: int | None = None,
    ) -> None:
        self.mesh = mesh
        self.peer = peer  # a point-to-point receive: its source rank ...
        self.tag = tag  # ... and tag
        self.cid = cid
        self.fingerprint = fingerprint
        self.timeout = timeout
        self.epoch = mesh.epoch
        self.task: asyncio.Task[Any] | None = None
        self.failure: BaseException | None = None
        self.running = False
        self._rank = mesh.rank
        self._size = mesh.size
        self._chunk_bytes = mesh.config.chunk_bytes

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def chunk_bytes(self) -> int:
        return self._chunk_bytes

    async def send(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        payload: memoryview | None = None,
        *,
        meta: dict[str, Any] | None = None,
        lane: Lane = Lane.DATA,
    ) -> Receipt:
        env = Envelope(
            _KINDS[lane], self.epoch, self._rank, self.cid, step, chunk, self.fingerprint, meta
        )
        return await self.mesh.send(peer, env, () if payload is None else (payload,))

    async def recv(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        *,
        nbytes: int | None = None,
        lane: Lane = Lane.DATA,
    ) -> Received:
        env, frames = await self.mesh.mailbox.get((self.epoch, self.cid), (peer, lane))
        if env.step != step or env.chunk != chunk:
            raise ProtocolError(
                f"collective #{self.cid}: rank {peer} sent step {env.step} chunk {env.chunk} "
                f"where step {step} chunk {chunk} was due"
            )
        if len(frames) > 1:
            raise ProtocolError(f"collective #{self.cid}: rank {peer} sent {len(frames)} frames")
        payload = frames[0] if frames else _EMPTY
        if nbytes is not None and payload.nbytes != nbytes:
            raise ProtocolError(
                f"collective #{self.cid}: rank {peer} sent {payload.nbytes} bytes for step "
                f"{step} chunk {chunk}, expected {nbytes}"
            )
        return Received(payload, env.body)

    def fail(self, error: BaseException) -> None:
        """Make the operation raise `error` (first failure wins).

        A call whose task has not started yet only records the error: the runner checks it
        first thing (cancelling a task before its first step would skip the runner).
        """
        if self.failure is not None or (self.task is not None and self.task.done()):
            return
        self.failure = error
        if self.running and self.task is not None:
            self.task.cancel()

    def __repr__(self) -> str:
        return f"<Call #{self.cid} epoch={self.epoch} {self.fingerprint.describe()}>"
