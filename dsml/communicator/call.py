"""One operation in flight, seen by algorithms as a `Group` (communicator layer).

A `Call` stamps every message it sends with its epoch, collective id and fingerprint, and
takes the messages addressed to it from the call table's mailbox, checking that each is
the step and chunk the algorithm expects with the payload size it expects.

When the operation must fail (a peer's abort, a mismatch seen on arrival, a lost peer, its
deadline) whoever notices calls `fail(error)`. The error is a value: it is put in the
call's `failed` future, and every wait of the call (a message from the mailbox, room to
send, a payload's receipt) watches that future and raises the error. Nothing is
cancelled; cancellation of a call's task only ever means that the user cancelled it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..collectives.group import Lane, Receipt, Received
from ..errors import ProtocolError
from ..wire import Envelope, Fingerprint, Kind
from . import stats

if TYPE_CHECKING:
    from .call_table import CallTable

__all__ = ["Call", "DeadlinePassed"]

_EMPTY = memoryview(b"")
_KINDS = {Lane.DATA: Kind.CHUNK, Lane.CONFIRM: Kind.CONFIRM}


class DeadlinePassed(Exception):
    """Delivered to a call whose budget ran out; the runner turns it into a
    `CollectiveTimeoutError` after asking the peers where they are."""


class Call:
    """A collective (or a point-to-point receive) of one epoch; implements Group."""

    def __init__(
        self,
        table: CallTable,
        cid: int,
        fingerprint: Fingerprint,
        timeout: float,
        *,
        peer: int | None = None,
        tag: int | None = None,
    ) -> None:
        self.table = table
        self.peer = peer  # a point-to-point receive: its source rank ...
        self.tag = tag  # ... and tag
        self.cid = cid
        self.fingerprint = fingerprint
        self.timeout = timeout
        self.epoch = table.epoch
        self.task: asyncio.Task[Any] | None = None
        #: the error this call ends with (first failure wins; the runner may refine it)
        self.failure: BaseException | None = None
        #: resolved with the first failure: what every wait of the call watches
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.over = False  # set once the call's body has ended: no deadline applies any more
        #: its entry in `comm.stats()` (set by the runner when the call's task starts)
        self.record: stats.CallRecord | None = None
        self._rank = table.rank
        self._size = table.size
        self._chunk_bytes = table.config.chunk_bytes

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def chunk_bytes(self) -> int:
        return self._chunk_bytes

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

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
            _KINDS[lane],
            self.epoch,
            self._rank,
            self.cid,
            step,
            chunk,
            fingerprint=self.fingerprint,
            body=meta,
        )
        links = self.table.links
        parts = () if payload is None else (payload,)
        receipt = links.try_send(peer, env, parts)
        if receipt is None:  # the peer's queue is full: wait for room, or for a failure
            record = stats.current.get()
            if record is not None:
                record.enter(stats.WIRE)
            try:
                receipt = await self.unless_failed(links.send_in_turn(peer, env, parts))
            finally:
                if record is not None:
                    record.leave(stats.WIRE)
        return receipt if receipt.done() else _Watched(receipt, self)

    async def recv(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        *,
        nbytes: int | None = None,
        lane: Lane = Lane.DATA,
    ) -> Received:
        record = stats.current.get()
        blocked = record.enter_receive(peer) if record is not None else 0
        try:
            env, frames = await self.table.mailbox.get(
                (self.epoch, self.cid), (peer, lane), unless=self.failed
            )
        finally:
            if record is not None:
                record.leave(blocked)
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

    async def unless_failed(self, waited: asyncio.Future[Any]) -> Any:
        """The result of `waited`, or this call's failure raised if it comes first.

        `waited` is left running (a queued send is not unsent when its call fails).
        """
        if self.failure is None and not waited.done():
            await asyncio.wait((waited, self.failed), return_when=asyncio.FIRST_COMPLETED)
        if self.failure is not None and not waited.done():
            raise self.failure
        return waited.result()

    def fail(self, error: BaseException) -> bool:
        """Make the operation raise `error` where it waits (first failure wins); returns
        whether this was the first."""
        if self.failure is not None or self.done:
            return False
        self.failure = error
        self.failed.set_result(error)
        return True

    def __repr__(self) -> str:
        state = f" failed={type(self.failure).__name__}" if self.failure is not None else ""
        return f"<Call #{self.cid} epoch={self.epoch} {self.fingerprint.describe()}{state}>"


class _Watched:
    """A receipt whose wait also ends (raising) when its call fails."""

    __slots__ = ("_call", "_inner")

    def __init__(self, inner: Receipt, call: Call) -> None:
        self._inner = inner
        self._call = call

    def done(self) -> bool:
        return self._inner.done()

    async def wait(self) -> None:
        if not self._inner.done():
            waiting = asyncio.ensure_future(self._inner.wait())
            record = stats.current.get()
            if record is not None:
                record.enter(stats.WIRE)
            try:
                await self._call.unless_failed(waiting)
            finally:
                if record is not None:
                    record.leave(stats.WIRE)
                if not waiting.done():
                    waiting.cancel()  # only our own wait on the tracker, not the send
